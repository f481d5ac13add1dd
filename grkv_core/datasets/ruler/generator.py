"""The public RULER generator: one sample, or many, as :class:`EvalSample` rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grkv_core.datasets.ruler.builders import fit_cwe, unit_builder
from grkv_core.datasets.ruler.corpora import DataDir
from grkv_core.datasets.ruler.draws import needle_depth
from grkv_core.datasets.ruler.prompts import fit_to_budget, make_token_counter
from grkv_core.datasets.ruler.tasks import (
    RULER_DEFAULT_CONTEXT_LENGTH,
    RULER_DEFAULT_SAMPLES_PER_TASK,
    RULER_TASK_SPECS,
    validate_ruler_tasks,
)
from grkv_core.datasets.schema import EvalSample


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
            f"{task}: context_length {context_length} leaves no room beside {spec.max_new_tokens} answer tokens"
        )
    try:
        if spec.family == "cwe":
            prompt, tokens = fit_cwe(task, seed, index, count_tokens, budget)
        else:
            build = unit_builder(task, spec, seed, index, depth, data_dir)
            num_units, tokens = fit_to_budget(build, count_tokens, budget)
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
