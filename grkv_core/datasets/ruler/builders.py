"""RULER's task builders: each returns ``build(n) -> Prompt``, the prompt with n haystack units."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from grkv_core.datasets.ruler.corpora import DataDir, load_essay_corpus, load_qa_corpus, load_word_lists
from grkv_core.datasets.ruler.draws import (
    DistinctDraws,
    draw_coded_word,
    draw_number,
    draw_uuid,
    draw_variable_name,
    seeded_rng,
)
from grkv_core.datasets.ruler.prompts import Prompt, TokenCounter, fit_to_budget, join_with_insertions
from grkv_core.datasets.ruler.tasks import (
    CWE_FREQUENCY_SCHEDULE,
    CWE_NUM_COMMON_WORDS,
    FWE_FILLER,
    FWE_ZIPF_NORMALISER,
    NOISE_SENTENCES,
    VT_NUM_HOPS,
    NeedleSpec,
    RulerTaskSpec,
)

_SENTENCE_END = (".", "?", "!", '."', '?"', '!"')
_Item = TypeVar("_Item")


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
) -> Callable[[int], Prompt]:
    rng = seeded_rng(task, seed, index, "needles")
    word_lists = load_word_lists()

    def draw_word_key(draw_rng: random.Random) -> str:
        return f"{draw_rng.choice(word_lists.adjectives)}-{draw_rng.choice(word_lists.nouns)}"

    draw_key = draw_uuid if spec.key_kind == "uuid" else draw_word_key
    draw_value = draw_uuid if spec.value_kind == "uuid" else draw_number
    keys = DistinctDraws(seeded_rng(task, seed, index, "keys"), draw_key)
    values = DistinctDraws(seeded_rng(task, seed, index, "values"), draw_value)
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

    def build(n: int) -> Prompt:
        if spec.haystack == "noise":
            units, separator = _noise_units(n), " "
            positions = [round(needle["depth"] * n) for needle in needles]
        elif spec.haystack == "essay":
            units, separator = _cycled(corpus.words, n), " "
            positions = [_nearest_sentence_boundary(units, round(needle["depth"] * n)) for needle in needles]
        else:
            # Distractor lines continue the key and value streams, so they never repeat a needle's
            # key or value.
            distractor_keys = keys.first(spec.num_keys + n)[spec.num_keys :]
            distractor_values = values.first(num_needles + n)[num_needles:]
            units = [needle_text(key, value) for key, value in zip(distractor_keys, distractor_values)]
            separator = "\n"
            positions = [round(needle["depth"] * n) for needle in needles]
        insertions = [
            (position, needle_text(needle["key"], needle["value"])) for position, needle in zip(positions, needles)
        ]
        haystack, offsets = join_with_insertions(units, insertions, separator)
        return Prompt(
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


def _vt_builder(task: str, seed: int, index: int) -> Callable[[int], Prompt]:
    rng = seeded_rng(task, seed, index, "chain")
    names = DistinctDraws(rng, draw_variable_name).first(VT_NUM_HOPS + 1)
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

    def build(n: int) -> Prompt:
        insertions = [(round(depth * n), statement) for depth, statement in zip(depths, statements)]
        haystack, offsets = join_with_insertions(_noise_units(n), insertions, " ")
        return Prompt(
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
) -> tuple[Callable[[int], Prompt], int]:
    """Builder over the number of distinct rare words, and how many rare words exist."""
    vocabulary = load_word_lists().all_words
    order = seeded_rng(task, seed, index, "words").sample(vocabulary, len(vocabulary))
    common, rare_pool = order[:CWE_NUM_COMMON_WORDS], order[CWE_NUM_COMMON_WORDS:]
    intro = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n"
    )
    question = "Question: What are the 10 most common words in the above list?"
    answer_prefix = " Answer: The top 10 words that appear most often in the list are:"

    def build(n: int) -> Prompt:
        words = common * frequent_count + rare_pool[:n] * rare_count
        seeded_rng(task, seed, index, "shuffle").shuffle(words)
        haystack = " ".join(f"{number}. {word}" for number, word in enumerate(words, start=1))
        return Prompt(
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


def _fwe_builder(task: str, seed: int, index: int) -> Callable[[int], Prompt]:
    coded_words = DistinctDraws(seeded_rng(task, seed, index, "vocabulary"), draw_coded_word)
    intro = (
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words. "
    )
    question = (
        "Question: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?"
    )
    answer_prefix = " Answer: According to the coded text above, the three most frequently appeared words are:"

    def build(n: int) -> Prompt:
        counts = _fwe_counts(n)
        vocabulary = [FWE_FILLER] + coded_words.first(max(len(counts) - 1, 0))
        words = [word for word, count in zip(vocabulary, counts) for _ in range(count)]
        seeded_rng(task, seed, index, "shuffle").shuffle(words)
        haystack = " ".join(words)
        return Prompt(
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
) -> Callable[[int], Prompt]:
    corpus = load_qa_corpus(source, data_dir)
    # One fixed question order per (task, seed): index i always asks the same question, however many
    # samples are drawn, and consecutive indices ask different questions.
    num_items = len(corpus.items)
    question_order = seeded_rng(task, seed, -1, "question-order").sample(range(num_items), num_items)
    item = corpus.items[question_order[index % len(question_order)]]
    rng = seeded_rng(task, seed, index, "documents")
    distractor_pool = [number for number in range(len(corpus.documents)) if number not in item.excluded_documents]
    distractor_order = rng.sample(distractor_pool, len(distractor_pool))
    # The first gold paragraph carries the sample's depth; further ones land at random depths.
    gold_depths = [depth] + [rng.random() for _ in item.gold_documents[1:]]
    instruction = (
        "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    )
    intro = f"{instruction}\n\nThe following are given documents.\n\n"
    question = f"{instruction}\n\nQuestion: {item.question}"

    def build(n: int) -> Prompt:
        document_ids = _cycled(distractor_order, n)
        # Inserting from the back keeps the earlier positions valid.
        positions = [round(gold_depth * n) for gold_depth in gold_depths]
        for position, gold in sorted(zip(positions, item.gold_documents), reverse=True):
            document_ids.insert(position, gold)
        blocks = [
            f"Document {number}:\n{corpus.documents[document]}" for number, document in enumerate(document_ids, start=1)
        ]
        haystack = "\n\n".join(blocks)
        gold_numbers = [document_ids.index(gold) + 1 for gold in item.gold_documents]
        return Prompt(
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


def unit_builder(
    task: str, spec: RulerTaskSpec, seed: int, index: int, depth: float, data_dir: DataDir
) -> Callable[[int], Prompt]:
    """``build(n)`` for every family but cwe (whose search also moves word frequencies)."""
    if spec.needle is not None:
        return _niah_builder(task, spec.needle, seed, index, depth, data_dir)
    if spec.qa_source is not None:
        return _qa_builder(task, spec.qa_source, seed, index, depth, data_dir)
    if spec.family == "vt":
        return _vt_builder(task, seed, index)
    return _fwe_builder(task, seed, index)


def fit_cwe(task: str, seed: int, index: int, count_tokens: TokenCounter, budget: int) -> tuple[Prompt, int]:
    for frequent_count, rare_count in CWE_FREQUENCY_SCHEDULE:
        build, pool_size = _cwe_builder(task, seed, index, frequent_count, rare_count)
        if count_tokens(build(0).full_text) > budget / 2:
            continue
        while True:
            num_rare, tokens = fit_to_budget(build, count_tokens, budget, max_units=pool_size)
            if num_rare < pool_size or rare_count + 1 >= frequent_count:
                return build(num_rare), tokens
            # Every rare word is used and there is room left: repeat them more often, staying below
            # the common words' frequency.
            rare_count += 1
            build, pool_size = _cwe_builder(task, seed, index, frequent_count, rare_count)
    raise ValueError(f"cwe: a budget of {budget} tokens is too small for {CWE_NUM_COMMON_WORDS} repeated common words")
