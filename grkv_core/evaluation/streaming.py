"""Bounded caches over a stream, without decoding: teacher-forced text fed in chunks, the cache compressed after each.

The first ``prefill_tokens`` tokens are prefilled, then the rest follows in chunks of the press's
``compression_interval`` tokens; ``MergingDecodingPress`` brings every layer back to its ``target_size`` after each
chunk (it counts tokens, not forward calls). At every chunk boundary the cache is therefore exactly the one that
decoding the same tokens one at a time holds (``tests/test_streaming.py``), at a fraction of the forwards. Two
measurements:

- ``stream_nll``: the negative log-likelihood of every streamed token given the bounded cache (the bounded-cache
  perplexity of StreamingLLM and H2O), per token, so texts and presses can be paired;
- ``stream_context``: a context streamed into a bounded cache, which the answer metrics then read
  (``grkv_core.evaluation.answer_metrics``).

NOTE: positions belong to the stream, never to the cache's length: every chunk is passed its stream ``position_ids``
(RoPE), and its causal mask is built here from the rows each kind of layer holds. transformers builds one mask from
the first layer's cache, which is right only while every layer holds the same rows; a model with sliding-window
layers (kept whole, hence longer than the compressed global layers) gets one mask per layer kind.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from grkv_core.presses.sliding_layers import SLIDING_LAYER_TYPE, language_model, sliding_layer_indices


@dataclass(frozen=True)
class StreamedText:
    """What streaming one text left.

    Attributes
    ----------
    token_nll : torch.Tensor
        (T,) float32: the NLL (nats) of each streamed token after the prefill, in stream order (T = n − prefill).
    cache : DynamicCache
        The cache after the last chunk (bounded when a press ran; the last chunk's compression done).
    kept_positions : dict of int to torch.Tensor
        Per compressed layer, (B, H_kv, rows) the stream position of each cached row (empty without a press).
    """

    token_nll: torch.Tensor
    cache: DynamicCache
    kept_positions: dict[int, torch.Tensor]


def check_stream(length: int, prefill_tokens: int, interval: int) -> None:
    """One-line ValueErrors for a stream that cannot be run: nothing after the prefill, or bad sizes."""
    if interval < 1:
        raise ValueError(f"compression_interval must be an integer >= 1, got {interval}")
    if not 1 <= prefill_tokens < length:
        raise ValueError(
            f"prefill_tokens must be in [1, {length - 1}] for a {length}-token text (some tokens must be streamed "
            f"after it), got {prefill_tokens}"
        )


def stream_chunks(length: int, prefill_tokens: int, interval: int) -> list[slice]:
    """The stream's forwards: the prefill, then chunks of ``interval`` tokens (the last one shorter)."""
    check_stream(length, prefill_tokens, interval)
    return [slice(0, prefill_tokens)] + [
        slice(start, min(start + interval, length)) for start in range(prefill_tokens, length, interval)
    ]


def chunk_attention_mask(model: PreTrainedModel, cache: DynamicCache, start: int, tokens: int):
    """The causal mask of a chunk of ``tokens`` at stream positions ``start``… over ``cache`` as it is before the
    chunk, or None where transformers' own is right (every layer holds as many rows).

    Returns
    -------
    dict or None
        ``{"full_attention": (1, 1, t, r_full + t), "sliding_attention": (1, 1, t, r_sliding + t)}`` bool masks
        (True: attend), as Gemma 3's decoder takes them.

    NOTE: a compressed global layer holds rows from before the chunk only, all visible; a sliding layer holds the
    whole stream in order (a cache made without a config keeps every row), so its rows' positions are their indices.
    """
    sliding = sliding_layer_indices(model)
    if not cache.layers or not sliding:
        return None
    layers = range(len(cache.layers))
    global_rows = {cache.layers[index].keys.shape[2] for index in layers if index not in sliding}
    sliding_rows = {cache.layers[index].keys.shape[2] for index in layers if index in sliding}
    if len(global_rows) != 1 or sliding_rows != {start}:
        raise ValueError(
            "a streamed chunk needs every global layer to hold as many rows and the sliding layers the whole stream; "
            f"got global layers {sorted(global_rows)}, sliding layers {sorted(sliding_rows)} at position {start}"
        )
    device = cache.layers[0].keys.device
    query = torch.arange(start, start + tokens, device=device)[:, None]
    rows = global_rows.pop()
    in_chunk = torch.arange(tokens, device=device)
    full = torch.cat([torch.ones(tokens, rows, dtype=torch.bool, device=device), in_chunk <= in_chunk[:, None]], 1)
    key = torch.arange(start + tokens, device=device)[None]
    window = model.config.get_text_config().sliding_window
    sliding_mask = (key <= query) & (query - key < window)
    return {"full_attention": full[None, None], SLIDING_LAYER_TYPE: sliding_mask[None, None]}


def run_chunk(
    model: PreTrainedModel, cache: DynamicCache, token_ids: torch.Tensor, start: int, logits_to_keep: int
) -> torch.Tensor:
    """Run ``token_ids`` (1, t) at stream positions ``start``… on ``cache``; (1, k, vocab) logits of the last k."""
    tokens = token_ids.shape[1]
    positions = torch.arange(start, start + tokens, device=model.device)[None]
    mask = chunk_attention_mask(model, cache, start, tokens)
    extra = {} if mask is None else {"attention_mask": mask}
    return model(
        input_ids=token_ids.to(model.device),
        past_key_values=cache,
        position_ids=positions,
        logits_to_keep=logits_to_keep,
        **extra,
    ).logits


def stream_text(
    model: PreTrainedModel, token_ids: torch.Tensor, press=None, prefill_tokens: int | None = None
) -> StreamedText:
    """Teacher-force ``token_ids`` (1, n) through a bounded cache and score every token after the prefill.

    Parameters
    ----------
    press : MergingDecodingPress, optional
        The press that bounds the cache; None: the full cache (the reference), streamed in the same chunks (of
        ``prefill_tokens`` then 512).
    prefill_tokens : int, optional
        Tokens prefilled before the stream; None: the press's ``target_size`` (so the first compression comes after
        the first chunk), 512 without a press.
    """
    return _stream(model, token_ids, press, prefill_tokens, score=True)


def stream_context(
    model: PreTrainedModel, context_ids: torch.Tensor, press=None, prefill_tokens: int | None = None
) -> StreamedText:
    """``stream_text`` without the scores: the cache a context leaves once streamed (``token_nll`` is empty)."""
    return _stream(model, context_ids, press, prefill_tokens, score=False)


def _stream(model, token_ids, press, prefill_tokens, score: bool) -> StreamedText:
    if token_ids.ndim != 2 or token_ids.shape[0] != 1:
        raise ValueError(f"token_ids must be (1, n): one stream at a time, got shape {tuple(token_ids.shape)}")
    interval = press.compression_interval if press is not None else _REFERENCE_CHUNK
    if prefill_tokens is None:
        prefill_tokens = min(press.target_size if press is not None else _REFERENCE_CHUNK, token_ids.shape[1] - 1)
    chunks = stream_chunks(token_ids.shape[1], prefill_tokens, interval)
    cache = DynamicCache()
    scores: list[torch.Tensor] = []
    kept: dict[int, torch.Tensor] = {}
    # NOTE: the press leaves sliding-window layers whole itself (``MergingDecodingPress.__call__``).
    with press(model) if press is not None else nullcontext(), torch.inference_mode():
        for chunk in chunks:
            tokens = chunk.stop - chunk.start
            keep = tokens if score and chunk.start > 0 else 1
            logits = run_chunk(model, cache, token_ids[:, chunk], chunk.start, keep)
            if score:
                # NOTE: scored chunk by chunk (a stream's logits at once would be n × vocab floats): the logits at
                # position t predict token t + 1, the prefill's last the first streamed token; the last chunk's last
                # predicts nothing.
                targets = token_ids[0, chunk.stop - keep + 1 : chunk.stop + 1].to(logits.device)
                log_probs = torch.log_softmax(logits[0, : targets.numel()].float(), dim=-1)
                scores.append(-log_probs.gather(-1, targets[:, None])[:, 0].cpu())
        if press is not None:
            decoder_layers = range(len(language_model(model).layers))
            kept = {index: press.kept_positions(index) for index in decoder_layers}
            kept = {index: positions for index, positions in kept.items() if positions is not None}
    token_nll = torch.cat(scores) if score else torch.empty(0)
    return StreamedText(token_nll, cache, kept)


# The chunk of a full-cache stream: what it computes does not depend on it (no compression), only its memory does.
_REFERENCE_CHUNK = 512
