"""Greedy answers for several compressed caches of one context at once: one batch row per cache.

Caches of equal per-layer lengths (the same budget, and masked or not alike) are stacked along the batch axis
and decoded together: the question is appended to every row at the same positions (continuing from the
original context length), and each row stops on its own (its later tokens are computed and ignored). Each row's
answer is what ``grkv_core.evaluation.generation.answer_question`` gives for its cache alone (the tests check it
token for token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from transformers import DynamicCache, PreTrainedModel

from grkv_core.cache.per_head import PerHeadLayer, stacked_rows
from grkv_core.evaluation.generation import Answer, append_question
from grkv_core.evaluation.shared_prefill import PER_CACHE_MODULE_STATE, PressedCache, attention_modules


def answer_batch(
    model: PreTrainedModel,
    caches: list[PressedCache],
    question_ids: torch.Tensor,
    context_length: int,
    max_new_tokens: int,
    stop_token_ids: set[int],
    max_rows: int | None = None,
    on_decode_step: Callable[[list[int], list[int]], None] | None = None,
) -> list[Answer]:
    """Answer ``question_ids`` (1, q) on every cache; one ``Answer`` per cache, in order. Caches are left as they were.

    Parameters
    ----------
    caches : list of PressedCache
        Compressed caches of the same context (``grkv_core.evaluation.shared_prefill.prefill_shared``).
    context_length : int
        The uncompressed context length: positions continue from it whatever the cache lengths are.
    max_rows : int, optional
        At most this many caches per batch (memory); all caches of equal lengths at once by default.
    on_decode_step : callable, optional
        Called before each single-token decoding forward with (cache indices of the batch rows, the rows whose
        answer is still being generated, i.e. those whose forward ``answer_question`` would also run).

    Returns
    -------
    list of Answer
        ``question_seconds`` and ``decode_seconds`` are those of the cache's whole batch.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    answers: list[Answer | None] = [None] * len(caches)
    for rows in cache_batches(caches, max_rows):
        for index, answer in zip(
            rows,
            _answer_rows(
                model,
                [caches[i] for i in rows],
                rows,
                question_ids,
                context_length,
                max_new_tokens,
                stop_token_ids,
                on_decode_step,
            ),
        ):
            answers[index] = answer
    return answers


def cache_batches(caches: list[PressedCache], max_rows: int | None = None) -> list[list[int]]:
    """The caches' indices in batches that can run as one: equal per-layer lengths, masked or not alike, at most
    ``max_rows`` each."""
    # NOTE: masked caches never share a batch with unmasked ones: kvpress's attention patch builds fake keys from
    # the queries of every row of a batch once any row is masked, and may find none for a row that needs none.
    groups: dict[tuple, list[int]] = {}
    for index, cache in enumerate(caches):
        groups.setdefault((cache.lengths(), cache.masked, cache.per_head), []).append(index)
    batches = []
    for members in groups.values():
        step = max_rows or len(members)
        batches += [members[start : start + step] for start in range(0, len(members), step)]
    return batches


def stacked_cache(caches: list[PressedCache]) -> DynamicCache:
    """One cache whose batch rows are ``caches`` (of equal per-layer lengths, per-head or not alike), in order."""
    stacked = DynamicCache()
    for layer in range(len(caches[0].cache.layers)):
        rows = [cache.cache.layers[layer] for cache in caches]
        if isinstance(rows[0], PerHeadLayer):
            stacked.layers.append(
                PerHeadLayer(stacked_rows([row.keys for row in rows]), stacked_rows([row.values for row in rows]))
            )
        else:
            stacked.update(torch.cat([row.keys for row in rows]), torch.cat([row.values for row in rows]), layer)
    return stacked


@contextmanager
def module_state_of(model: PreTrainedModel, caches: list[PressedCache]):
    """Put the rows' module state on the attention modules (masked entries offset to each row), then clear it."""
    attentions = attention_modules(model)
    try:
        for layer, attention in enumerate(attentions):
            parts = [cache.module_state[layer].get("masked_key_indices") for cache in caches]
            masked = None
            if any(part is not None for part in parts):
                rows = [
                    (batch + row, heads, positions)
                    for row, part in enumerate(parts)
                    if part is not None
                    for batch, heads, positions in [part]
                ]
                masked = tuple(torch.cat([row[axis] for row in rows]) for axis in range(3))
            attention.masked_key_indices = masked
        yield
    finally:
        for attention in attentions:
            for name in PER_CACHE_MODULE_STATE:
                setattr(attention, name, None)


def _answer_rows(
    model, caches, indices, question_ids, context_length, max_new_tokens, stop_token_ids, on_decode_step
) -> list[Answer]:
    device = model.device
    rows = len(caches)
    stacked = stacked_cache(caches)
    generated: list[list[int]] = [[] for _ in range(rows)]
    active = [True] * rows
    with module_state_of(model, caches), torch.inference_mode():
        start = time.perf_counter()
        next_tokens = append_question(model, stacked, question_ids.expand(rows, -1), context_length).argmax(-1).tolist()
        question_seconds = time.perf_counter() - start
        position = context_length + question_ids.shape[1]
        steps = 0
        start = time.perf_counter()
        while True:
            for row in range(rows):
                if active[row]:
                    if next_tokens[row] in stop_token_ids:
                        active[row] = False
                    else:
                        generated[row].append(next_tokens[row])
                        active[row] = len(generated[row]) < max_new_tokens
            if not any(active):
                break
            if on_decode_step is not None:
                on_decode_step(indices, active)
            logits = model(
                input_ids=torch.tensor(next_tokens, device=device)[:, None],
                past_key_values=stacked,
                position_ids=torch.full((rows, 1), position, device=device),
            ).logits
            next_tokens = logits[:, -1].argmax(-1).tolist()
            position += 1
            steps += 1
        decode_seconds = time.perf_counter() - start
    return [
        Answer(token_ids=tokens, question_seconds=question_seconds, decode_seconds=decode_seconds, decode_steps=steps)
        for tokens in generated
    ]
