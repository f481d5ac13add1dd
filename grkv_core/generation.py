"""The kvpress evaluation protocol as plain functions: compress the context alone, then answer questions.

The context is prefilled under the press (compression happens in its forward hooks); each question is
appended to the compressed cache with positions continuing from the *original* context length, answered
greedily, and the cache is cropped back so the next question sees the same compressed context.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from grkv_core.datasets.schema import EvalSample


@dataclass(frozen=True)
class Answer:
    """Greedy answer to one question. ``token_ids`` excludes the question; times are wall seconds.

    ``decode_steps`` counts the single-token forwards behind ``decode_seconds`` (in a batch: the batch's).
    """

    token_ids: list[int]
    question_seconds: float
    decode_seconds: float
    decode_steps: int


def prefill(model: PreTrainedModel, context_ids: torch.Tensor, press=None) -> DynamicCache:
    """Run the decoder over ``context_ids`` (1, n) under ``press`` and return the (compressed) cache."""
    if context_ids.ndim != 2:
        raise ValueError(f"context_ids must be (batch, n), got shape {tuple(context_ids.shape)}")
    cache = DynamicCache()
    with press(model) if press is not None else contextlib.nullcontext(), torch.inference_mode():
        model.model(input_ids=context_ids.to(model.device), past_key_values=cache)
    return cache


def cache_lengths(cache: DynamicCache) -> list[int]:
    return [layer.keys.shape[2] for layer in cache.layers]


def crop_cache(cache: DynamicCache, lengths: list[int]) -> None:
    """Cut every layer back to ``lengths`` (per layer: PyramidKV budgets differ between layers)."""
    for layer, length in zip(cache.layers, lengths):
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def append_question(model: PreTrainedModel, cache: DynamicCache, question_ids: torch.Tensor,
                    context_length: int) -> torch.Tensor:
    """Run ``question_ids`` (B, q) on ``cache`` at positions continuing from ``context_length``; (B, vocab) last logits.

    NOTE: transformers builds one causal mask for all layers from the first layer's cache length, which fails when
    layers keep different numbers of tokens (PyramidKV's budgets). Such a cache takes the question one token at a
    time: a single query needs no mask, and attending token by token is causal by construction.
    """
    device = model.device
    question_ids = question_ids.to(device)
    rows, length = question_ids.shape
    chunks = [slice(0, length)] if len(set(cache_lengths(cache))) == 1 else [slice(i, i + 1) for i in range(length)]
    for chunk in chunks:
        positions = torch.arange(context_length + chunk.start, context_length + chunk.stop, device=device)
        logits = model(input_ids=question_ids[:, chunk], past_key_values=cache,
                       position_ids=positions[None].expand(rows, -1), logits_to_keep=1).logits
    return logits[:, -1]


def answer_question(
    model: PreTrainedModel,
    cache: DynamicCache,
    question_ids: torch.Tensor,
    context_length: int,
    max_new_tokens: int,
    stop_token_ids: set[int],
) -> Answer:
    """Greedy-decode an answer to ``question_ids`` (1, q) over ``cache``, leaving the cache as it was.

    Parameters
    ----------
    context_length : int
        The uncompressed context length: positions continue from it whatever the cache length is.
    stop_token_ids : set of int
        Generation stops after emitting one of these (it is not included in ``token_ids``).
    """
    import time

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    lengths = cache_lengths(cache)
    device = model.device
    generated: list[int] = []
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            next_token = int(append_question(model, cache, question_ids, context_length)[0].argmax())
            question_seconds = time.perf_counter() - start
            position = context_length + question_ids.shape[1]
            steps = 0
            start = time.perf_counter()
            while next_token not in stop_token_ids:
                generated.append(next_token)
                if len(generated) >= max_new_tokens:
                    break
                logits = model(input_ids=torch.tensor([[next_token]], device=device), past_key_values=cache,
                               position_ids=torch.tensor([[position]], device=device)).logits
                next_token = int(logits[0, -1].argmax())
                position += 1
                steps += 1
            decode_seconds = time.perf_counter() - start
    finally:
        crop_cache(cache, lengths)
    return Answer(token_ids=generated, question_seconds=question_seconds, decode_seconds=decode_seconds,
                  decode_steps=steps)


def tokenize_sample(tokenizer, sample: EvalSample) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Context and question token ids as kvpress's pipeline builds them (chat template split at the context).

    Returns (1, n) context ids and one (1, q) tensor per question (question + template tail + answer prefix).
    """
    if tokenizer.chat_template is None:
        context = (tokenizer.bos_token or "") + sample.context
        suffix = "\n"
    else:
        separator = "#" * (len(sample.context) + 10)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": sample.context + separator}],
                                                 add_generation_prompt=True, tokenize=False)
        context, suffix = rendered.split(separator)
    encode = lambda text: torch.tensor([tokenizer.encode(text, add_special_tokens=False)])  # noqa: E731
    return encode(context), [encode(question + suffix + sample.answer_prefix) for question in sample.questions]


def stop_token_ids(loaded) -> set[int]:
    """The token ids that end an answer: the generation config's EOS ids and the tokenizer's."""
    eos = loaded.model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return ids
