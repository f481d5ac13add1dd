"""One sample under several presses: model + press + sample -> predictions, scores, costs and losses.

The protocol is kvpress's (see ``grkv_core.evaluation.generation``). Besides the score, every sample records what a
compression method costs and how faithful its cache is: time to first token (prefill including the
compression, plus the first question), decode latency, peak memory, the persistent KV bytes left after
compression, and the normalised reconstruction discrepancy of the compressed cache on the surrogate window,
on held-out queries (those of the first generated tokens) and on the question's own queries.

Several press configurations of one sample share its prefill and decode as one batch (``evaluate_trials``),
with the results of evaluating each alone: that is what makes a sweep's trials cheap.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time

import torch
from transformers import DynamicCache

from grkv_core.cache.per_head import EAGER_REFUSAL
from grkv_core.config import PROTOCOL_SPEC, QUESTION_AGNOSTIC, PressConfig
from grkv_core.datasets import EvalSample, score_prediction
from grkv_core.evaluation.answer_metrics import (
    AnswerMetrics,
    answer_log_probs,
    answer_metrics_batch,
    compare_to_reference,
    reference_ids,
)
from grkv_core.evaluation.batched_decoding import answer_batch
from grkv_core.evaluation.generation import answer_position, stop_token_ids, tokenize_sample
from grkv_core.evaluation.probe import ReconstructionProbe
from grkv_core.evaluation.results import SampleResult
from grkv_core.evaluation.shared_prefill import prefill_shared
from grkv_core.models import LoadedModel
from grkv_core.options import PAPER_WINDOW
from grkv_core.presses.from_config import BuiltPress, protected_window, refuses_eager, required_attention


class Evaluator:
    """A loaded model that evaluates samples under any press; load once, evaluate many (Ray workers do).

    Parameters
    ----------
    loaded : LoadedModel
        From ``grkv_core.models.load_model``.
    loss_window : int
        Number of last prompt positions whose queries measure the window reconstruction loss (the same for
        every press, whatever surrogate window the press itself uses).
    heldout_tokens : int
        Number of first generated tokens whose queries form the held-out set (0 disables it).
    protocol : str
        One of ``grkv_core.config.PROTOCOLS``: what the prefill holds
        (``grkv_core.evaluation.generation.render_sample``).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        loss_window: int = PAPER_WINDOW,
        heldout_tokens: int = 8,
        protocol: str = QUESTION_AGNOSTIC,
    ):
        PROTOCOL_SPEC.check("protocol", protocol)
        self.loaded = loaded
        self.loss_window = loss_window
        self.heldout_tokens = heldout_tokens
        self.protocol = protocol
        self.stop_ids = stop_token_ids(loaded)

    def evaluate_trials(
        self,
        sample: EvalSample,
        presses: list[PressConfig | BuiltPress],
        decode: bool = True,
        measure_reconstruction: bool = True,
        max_decode_rows: int | None = None,
        measure_answer: bool = True,
    ) -> list[SampleResult]:
        """Evaluate several press configurations on one sample; one result per configuration, in order.

        One prefill serves every configuration (``grkv_core.evaluation.shared_prefill``) and caches of equal lengths
        answer each question as one batch (``grkv_core.evaluation.batched_decoding``); the results are those of
        evaluating each configuration alone (``evaluate_sample``), except the times, which describe the shared work:
        prefill_s is the forward without any press's hooks plus this press's own, and TTFT and decoding are the
        batch's.

        Parameters
        ----------
        presses : list of PressConfig or BuiltPress
            The configurations, or presses built from them (``BuiltPress``: built once for every sample they run on).
        decode : bool
            False screens without generating: predictions and scores are empty, ``score`` and ``heldout_loss`` are
            None; the window and question losses (and the memory) are measured all the same.
        max_decode_rows : int, optional
            At most this many caches decoded (and teacher-forced) as one batch (memory).
        measure_answer : bool
            False leaves the answer metrics (``grkv_core.evaluation.answer_metrics``) None.
        """
        built = [press if isinstance(press, BuiltPress) else BuiltPress.of(press) for press in presses]
        for press in built:
            self._check_attention(press.config)
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        started = time.perf_counter()
        on_cuda = model.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(model.device)
        context_ids, questions_ids = tokenize_sample(tokenizer, sample, self.protocol)
        context_length = context_ids.shape[1]
        presses = [press.press for press in built]
        probe = ReconstructionProbe(model, self.loss_window, self.heldout_tokens if decode else 0)
        with probe.watching_prefill() if measure_reconstruction else contextlib.nullcontext():
            shared = prefill_shared(model, context_ids, presses)
        answer_metrics = self._teacher_force(
            sample,
            shared,
            presses,
            questions_ids,
            context_length,
            probe if measure_reconstruction else None,
            measure_answer,
            max_decode_rows,
        )
        position = answer_position(tokenizer, sample, self.protocol)
        depth = None if position is None else position / context_length
        predictions = [[] for _ in presses]
        scores = [[] for _ in presses]
        ttft = [cache.prefill_s for cache in shared.pressed]
        decode_s, decode_steps, generated = [0.0] * len(presses), [0] * len(presses), [0] * len(presses)
        if decode:
            for index, question_ids in enumerate(questions_ids):
                collect = measure_reconstruction and index == 0 and self.heldout_tokens > 0
                with probe.watching_decoding() if collect else contextlib.nullcontext():
                    answers = answer_batch(
                        model,
                        shared.pressed,
                        question_ids,
                        context_length,
                        sample.max_new_tokens,
                        self.stop_ids,
                        max_rows=max_decode_rows,
                        on_decode_step=probe.on_decode_step if collect else None,
                    )
                for trial, answer in enumerate(answers):
                    if index == 0:
                        ttft[trial] += answer.question_seconds
                    generated[trial] += len(answer.token_ids)
                    decode_s[trial] += answer.decode_seconds
                    decode_steps[trial] += answer.decode_steps
                    prediction = tokenizer.decode(answer.token_ids, skip_special_tokens=True)
                    predictions[trial].append(prediction)
                    scores[trial].append(score_prediction(sample, index, prediction))
        peak = torch.cuda.max_memory_allocated(model.device) if on_cuda else _process_peak_rss()
        full_kv_bytes = sum(keys.nbytes + values.nbytes for keys, values in shared.full)
        wall_s = (time.perf_counter() - started) / len(presses)
        results = []
        for trial, (press, cache) in enumerate(zip(presses, shared.pressed)):
            losses = dict(window_loss=None, heldout_loss=None, question_loss=None)
            if measure_reconstruction and press is None:
                losses = dict(
                    window_loss=0.0, heldout_loss=0.0 if probe.heldout.get(trial) else None, question_loss=0.0
                )
            elif measure_reconstruction:
                losses = probe.losses(trial, shared.full, cache)
            window = protected_window(press)
            results.append(
                SampleResult(
                    sample_id=sample.sample_id,
                    task=sample.task,
                    predictions=predictions[trial],
                    scores=scores[trial],
                    score=statistics.fmean(scores[trial]) if decode else None,
                    context_tokens=int(context_length),
                    ttft_s=ttft[trial],
                    prefill_s=cache.prefill_s,
                    decode_ms_per_token=1e3 * decode_s[trial] / max(decode_steps[trial], 1),
                    generated_tokens=generated[trial],
                    kv_bytes=cache.nbytes(),
                    full_kv_bytes=full_kv_bytes,
                    peak_memory_bytes=int(peak),
                    wall_s=wall_s,
                    batch_trials=len(presses),
                    **losses,
                    **answer_metrics[trial],
                    answer_depth=depth,
                    answer_in_window=None if position is None else position >= context_length - window,
                )
            )
        return results

    def _teacher_force(
        self,
        sample: EvalSample,
        shared,
        presses: list,
        questions_ids: list[torch.Tensor],
        context_length: int,
        probe: ReconstructionProbe | None,
        measure_answer: bool,
        max_rows: int | None,
    ) -> list[dict[str, float]]:
        """Each question and its reference answer teacher-forced on the full cache (seen by ``probe``, if any) and,
        with ``measure_answer``, on every compressed cache; per press, its answer metrics averaged over the
        questions ({} when not measured)."""
        per_press: list[list[AnswerMetrics]] = [[] for _ in presses]
        if probe is None and not measure_answer:
            return [{} for _ in presses]
        model = self.loaded.model
        compressed = [trial for trial, press in enumerate(presses) if press is not None]
        for index, question_ids in enumerate(questions_ids):
            answer_ids = reference_ids(self.loaded.tokenizer, sample, index)
            with probe.watching_question() if probe is not None else contextlib.nullcontext():
                reference = answer_log_probs(
                    model, DynamicCache(ddp_cache_data=shared.full), question_ids, answer_ids, context_length
                )[0]
            if not measure_answer:
                continue
            found = dict(
                zip(
                    compressed,
                    answer_metrics_batch(
                        model,
                        [shared.pressed[trial] for trial in compressed],
                        reference,
                        question_ids,
                        answer_ids,
                        context_length,
                        max_rows=max_rows,
                    ),
                )
            )
            # NOTE: the full cache is its own reference (KL exactly 0, every top-1 agreeing).
            itself = compare_to_reference(reference, reference[None], answer_ids)[0]
            for trial, metrics in enumerate(per_press):
                metrics.append(found.get(trial, itself))
        return [AnswerMetrics.mean(metrics) if metrics else {} for metrics in per_press]

    def evaluate_sample(
        self, sample: EvalSample, press_config: PressConfig, measure_reconstruction: bool = True
    ) -> SampleResult:
        """Evaluate one press configuration on one sample (its own prefill and decoding)."""
        return self.evaluate_trials(sample, [press_config], measure_reconstruction=measure_reconstruction)[0]

    def _check_attention(self, press_config: PressConfig) -> None:
        needs = required_attention(press_config.press)
        actual = self.loaded.model.config._attn_implementation
        if needs is not None and actual != needs:
            raise ValueError(
                f"press {press_config.press!r} needs attn_implementation={needs!r}; the model uses {actual!r}"
            )
        if refuses_eager(press_config.press) and actual == "eager":
            raise ValueError(f"press {press_config.press!r} does not work with eager attention; load with sdpa")
        if press_config.per_head_cache and actual == "eager":
            raise ValueError(EAGER_REFUSAL)


def _process_peak_rss() -> int:
    # NOTE: on CPU there is no per-sample allocator peak; this is the process's high-water mark (Linux: KiB).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
