"""Answer-aligned metrics without generation: how well each compressed cache predicts the reference answer.

Per question, the question and its reference answer are teacher-forced once on the full cache (the reference
distribution, shared by every press of the sample) and once on each compressed cache (caches of equal per-layer
lengths as one batch, like ``grkv_core.evaluation.batched_decoding``). Over the answer's positions (the logits that
predict its tokens):

- ``answer_nll``: the reference answer's mean token negative log-likelihood (nats);
- ``answer_kl``: the mean KL(p_full || p_compressed) (nats), exactly 0 for the full cache;
- ``answer_top1``: the fraction of positions whose most likely token is the full cache's.

A binary needle score ties on nearly every sample when a small model loses the needle; these separate methods on
the same caches, and one forward of q + a tokens per cache costs a fraction of decoding.

NOTE: the reference answer is the question's first reference (``reference_text``), as for the question loss of
``grkv_core.evaluation.probe``; for an all-of-them task (RULER's multi-value needles) that is the first needle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from grkv_core.datasets.schema import EvalSample
from grkv_core.evaluation.batched_decoding import cache_batches, module_state_of, stacked_cache
from grkv_core.evaluation.generation import cache_lengths, crop_cache, run_tokens
from grkv_core.evaluation.shared_prefill import PressedCache


def reference_text(sample: EvalSample, index: int) -> str:
    """The reference answer of question ``index`` as the model would continue its answer prefix: the first
    reference, after a space unless the prefix ends in whitespace (or is empty)."""
    reference = sample.references[index][0] if sample.references[index] else ""
    separator = "" if sample.answer_prefix.endswith((" ", "\n")) or not sample.answer_prefix else " "
    return separator + reference


def reference_ids(tokenizer, sample: EvalSample, index: int) -> torch.Tensor:
    """(1, a) the reference answer's token ids (at most ``sample.max_new_tokens``; EOS for an empty reference)."""
    ids = tokenizer.encode(reference_text(sample, index), add_special_tokens=False)[: sample.max_new_tokens]
    return torch.tensor([ids or [tokenizer.eos_token_id or 0]])


@dataclass(frozen=True)
class AnswerMetrics:
    """One cache's answer metrics on one question (see the module docstring)."""

    nll: float
    kl: float
    top1: float

    @staticmethod
    def mean(metrics: list[AnswerMetrics]) -> dict[str, float]:
        """``answer_nll``, ``answer_kl``, ``answer_top1`` averaged over questions (each already a per-token mean)."""
        count = len(metrics)
        return {
            "answer_nll": sum(m.nll for m in metrics) / count,
            "answer_kl": sum(m.kl for m in metrics) / count,
            "answer_top1": sum(m.top1 for m in metrics) / count,
        }


def answer_log_probs(
    model: PreTrainedModel,
    cache: DynamicCache,
    question_ids: torch.Tensor,
    answer_ids: torch.Tensor,
    context_length: int,
    one_at_a_time: bool = False,
) -> torch.Tensor:
    """Teacher-force ``question_ids`` then ``answer_ids`` on every row of ``cache``; the cache is left as it was.

    Parameters
    ----------
    cache : DynamicCache
        (B, H_kv, c, d) per layer: B caches of one context (c may differ between layers).
    question_ids : torch.Tensor
        (1, q) the question as appended after the prefill (template tail and answer prefix included).
    answer_ids : torch.Tensor
        (1, a) the reference answer.
    context_length : int
        The uncompressed prefill length: positions continue from it whatever the cache lengths are.
    one_at_a_time : bool
        Run the tokens one forward each (``grkv_core.evaluation.generation.run_tokens``).

    Returns
    -------
    torch.Tensor
        (B, a, vocab) float32 log-probabilities at the positions that predict each answer token.
    """
    rows = cache.layers[0].keys.shape[0]
    tokens = torch.cat([question_ids, answer_ids], dim=1).expand(rows, -1)
    lengths = cache_lengths(cache)
    try:
        with torch.inference_mode():
            logits = run_tokens(
                model,
                cache,
                tokens,
                context_length,
                logits_to_keep=answer_ids.shape[1] + 1,
                one_at_a_time=one_at_a_time,
            )
    finally:
        crop_cache(cache, lengths)
    return torch.log_softmax(logits[:, :-1].float(), dim=-1)


def compare_to_reference(
    reference: torch.Tensor, log_probs: torch.Tensor, answer_ids: torch.Tensor
) -> list[AnswerMetrics]:
    """The metrics of each row of ``log_probs`` (B, a, vocab) against the full cache's ``reference`` (a, vocab), for
    the answer tokens ``answer_ids`` (1, a)."""
    reference = reference.to(log_probs.device)
    targets = answer_ids.to(log_probs.device)[0]
    nll = -log_probs[:, torch.arange(targets.shape[0], device=log_probs.device), targets].mean(-1)
    full_probs = reference.exp()
    # NOTE: where the full cache gives a token probability 0 it adds nothing to the KL (0 log 0 = 0).
    kl = torch.where(full_probs > 0, full_probs * (reference - log_probs), 0.0).sum(-1).mean(-1)
    top1 = (log_probs.argmax(-1) == reference.argmax(-1)).float().mean(-1)
    return [AnswerMetrics(float(n), float(k), float(t)) for n, k, t in zip(nll, kl, top1)]


def answer_metrics_batch(
    model: PreTrainedModel,
    caches: list[PressedCache],
    reference: torch.Tensor,
    question_ids: torch.Tensor,
    answer_ids: torch.Tensor,
    context_length: int,
    max_rows: int | None = None,
) -> list[AnswerMetrics]:
    """Every cache's ``AnswerMetrics`` on one question, caches of equal lengths teacher-forced as one batch; the
    values are those of each cache alone (up to float rounding of a batched product).

    Parameters
    ----------
    caches : list of PressedCache
        Compressed caches of the same prefill (``grkv_core.evaluation.shared_prefill.prefill_shared``).
    reference : torch.Tensor
        (a, vocab) the full cache's log-probabilities at the answer positions (``answer_log_probs``).
    max_rows : int, optional
        At most this many caches per batch (memory).
    """
    metrics: list[AnswerMetrics | None] = [None] * len(caches)
    for rows in cache_batches(caches, max_rows):
        members = [caches[index] for index in rows]
        # NOTE: kvpress hides a masking press's evicted keys (AdaKV) behind one fake key per head that must score
        # below every query of the forward; for the q + a queries of a whole answer it often finds none, so
        # masked caches take the tokens one at a time.
        with module_state_of(model, members):
            log_probs = answer_log_probs(
                model, stacked_cache(members), question_ids, answer_ids, context_length, one_at_a_time=members[0].masked
            )
        for index, found in zip(rows, compare_to_reference(reference, log_probs, answer_ids)):
            metrics[index] = found
    return metrics
