"""The kvpress evaluation protocols as plain functions: compress the prefill, then answer questions.

The prefill (the context, or under the query-aware protocol the context and its question) runs under the press
(compression happens in its forward hooks); each question is appended to the compressed cache with positions
continuing from the *original* prefill length, answered greedily, and the cache is cropped back so the next
question sees the same compressed context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from grkv_core.config import PROTOCOL_SPEC, QUERY_AWARE, QUESTION_AGNOSTIC
from grkv_core.datasets.schema import EvalSample
from grkv_core.presses.sliding_layers import compressing


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
    if context_ids.ndim != 2 or context_ids.shape[1] == 0:
        raise ValueError(
            f"context_ids must be (batch, n) with n >= 1 (an empty context has nothing to prefill), got "
            f"shape {tuple(context_ids.shape)}"
        )
    cache = DynamicCache()
    with compressing(press, model), torch.inference_mode():
        model.model(input_ids=context_ids.to(model.device), past_key_values=cache)
    return cache


def cache_lengths(cache: DynamicCache) -> list[int]:
    return [layer.keys.shape[2] for layer in cache.layers]


def crop_cache(cache: DynamicCache, lengths: list[int]) -> None:
    """Cut every layer back to ``lengths`` (per layer: PyramidKV budgets differ between layers)."""
    for layer, length in zip(cache.layers, lengths):
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def run_tokens(
    model: PreTrainedModel,
    cache: DynamicCache,
    token_ids: torch.Tensor,
    context_length: int,
    logits_to_keep: int = 1,
    one_at_a_time: bool = False,
) -> torch.Tensor:
    """Run ``token_ids`` (B, t) on ``cache`` at positions continuing from ``context_length``; (B, k, vocab) logits
    of the last ``k = logits_to_keep`` tokens. The cache grows by the t tokens.

    NOTE: transformers builds one causal mask for all layers from the first layer's cache length, which fails when
    layers keep different numbers of tokens (PyramidKV's budgets). Such a cache takes the tokens one at a time (as
    does any with ``one_at_a_time``): a single query needs no mask, and attending token by token is causal by
    construction.
    """
    device = model.device
    token_ids = token_ids.to(device)
    rows, length = token_ids.shape
    if not 1 <= logits_to_keep <= length:
        raise ValueError(f"logits_to_keep must be in [1, {length}], got {logits_to_keep}")
    if len(set(cache_lengths(cache))) == 1 and not one_at_a_time:
        chunks, keep = [slice(0, length)], logits_to_keep
    else:
        chunks, keep = [slice(i, i + 1) for i in range(length)], 1
    kept = []
    for chunk in chunks:
        positions = torch.arange(context_length + chunk.start, context_length + chunk.stop, device=device)
        kept.append(
            model(
                input_ids=token_ids[:, chunk],
                past_key_values=cache,
                position_ids=positions[None].expand(rows, -1),
                logits_to_keep=keep,
            ).logits
        )
    return torch.cat(kept, dim=1)[:, -logits_to_keep:]


def append_question(
    model: PreTrainedModel, cache: DynamicCache, question_ids: torch.Tensor, context_length: int
) -> torch.Tensor:
    """Run ``question_ids`` (B, q) on ``cache`` at positions continuing from ``context_length``; (B, vocab) logits of
    the last token."""
    return run_tokens(model, cache, question_ids, context_length)[:, -1]


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
                logits = model(
                    input_ids=torch.tensor([[next_token]], device=device),
                    past_key_values=cache,
                    position_ids=torch.tensor([[position]], device=device),
                ).logits
                next_token = int(logits[0, -1].argmax())
                position += 1
                steps += 1
            decode_seconds = time.perf_counter() - start
    finally:
        crop_cache(cache, lengths)
    return Answer(
        token_ids=generated, question_seconds=question_seconds, decode_seconds=decode_seconds, decode_steps=steps
    )


def render_sample(tokenizer, sample: EvalSample, protocol: str = QUESTION_AGNOSTIC) -> tuple[str, list[str]]:
    """The prefill's text and each question's text as kvpress builds them (chat template split at the context).

    Question-agnostic (kvpress's pipeline): the context is the prefill, each question follows with the template's
    tail and the answer prefix. Query-aware (kvpress's evaluation ``query_aware``): the question is appended to the
    context and compressed with it; only the template's tail and the answer prefix follow.

    Raises
    ------
    ValueError
        For an unknown protocol, or a query-aware sample with several questions (each question would need its
        own prefill; kvpress's evaluation has one question per row).
    """
    PROTOCOL_SPEC.check("protocol", protocol)
    context, questions = sample.context, list(sample.questions)
    if protocol == QUERY_AWARE:
        if len(questions) != 1:
            raise ValueError(
                f"sample {sample.sample_id!r}: the query-aware protocol compresses one question with "
                f"its context, this sample has {len(questions)}; split it into one sample per question"
            )
        context, questions = context + questions[0], [""]
    if tokenizer.chat_template is None:
        context, suffix = (tokenizer.bos_token or "") + context, "\n"
    else:
        separator = "#" * (len(context) + 10)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + separator}], add_generation_prompt=True, tokenize=False
        )
        context, suffix = rendered.split(separator)
    return context, [question + suffix + sample.answer_prefix for question in questions]


def tokenize_sample(
    tokenizer, sample: EvalSample, protocol: str = QUESTION_AGNOSTIC
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Context and question token ids under ``protocol`` (``render_sample``).

    Returns (1, n) prefill ids and one (1, q) tensor per question (question + template tail + answer prefix; under
    the query-aware protocol the template tail and answer prefix alone).
    """
    if not sample.context.strip():
        raise ValueError(f"sample {sample.sample_id!r} ({sample.task}) has an empty context: nothing to compress")
    context, questions = render_sample(tokenizer, sample, protocol)
    encode = lambda text: torch.tensor([tokenizer.encode(text, add_special_tokens=False)])  # noqa: E731
    return encode(context), [encode(question) for question in questions]


def answer_position(tokenizer, sample: EvalSample, protocol: str = QUESTION_AGNOSTIC) -> int | None:
    """The prefill position of the first token of the sample's first reference answer where the context holds it
    (a RULER needle), else None: how far from the prefill's end the answer sits."""
    context, _ = render_sample(tokenizer, sample, protocol)
    reference = sample.references[0][0] if sample.references[0] else ""
    offset = context.find(reference) if reference.strip() else -1
    if offset < 0:
        return None
    return len(tokenizer.encode(context[:offset], add_special_tokens=False))


def stop_token_ids(loaded) -> set[int]:
    """The token ids that end an answer: the generation config's EOS ids and the tokenizer's."""
    eos = loaded.model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return ids
