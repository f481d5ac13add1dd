"""The Ray actor of a bounded-cache sweep: one loaded model and its texts; each trial streams them through its bounded
press (``grkv_core.evaluation.stream_eval``), the full cache's reference computed once per text for a whole batch.

NOTE: imports no Ray, like ``workers.trial_worker``, whose batching, failure handling and identity it shares.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from grkv_core.config import StreamConfig
from grkv_core.evaluation.stream_eval import StreamItem, StreamStore, evaluate_stream_item, load_stream_items
from grkv_core.models import load_model
from grkv_core.presses.from_config import BuiltPress
from grkv_core.stream_options import STREAM_NLL
from workers.names import FULL_STAGE, TEST_STAGE
from workers.protocol import TrialOutcome, TrialRequest
from workers.trial_worker import TrialWorker, check_device, split_samples

# A text's result (``evaluate_stream_item``) under the names the service's metrics have (``grkv_core.metrics``).
METRIC_NAMES = {"nll": "stream_nll", "seconds": "wall_s", "tokens": "streamed_tokens", "rows": "cache_rows"}


def stage_items(config: StreamConfig, test_samples: int, tokenizer) -> dict[str, list[StreamItem]]:
    """The texts each stage streams: ``stream_nll`` tunes on its domain's tune split and tests on its eval split
    (``test_samples`` texts); ``stream_answer`` loads ``samples + test_samples`` per task at once and tests on those
    after the first ``samples`` of each task."""
    if config.protocol == STREAM_NLL:
        tuning = load_stream_items(config, tokenizer)
        test = load_stream_items(replace(config, split="eval", samples=test_samples), tokenizer) if test_samples else []
        return {**split_samples(tuning, config.samples), TEST_STAGE: test}
    return split_samples(
        load_stream_items(replace(config, samples=config.samples + test_samples), tokenizer), config.samples
    )


def stream_summary(results: list[dict]) -> dict:
    """An evaluation summary the service reads as it reads a prefill one: no score, and under ``costs`` each metric's
    mean over the texts."""
    names = [name for name in results[0] if name != "item_id"] if results else []
    costs = {METRIC_NAMES.get(name, name): statistics.fmean(row[name] for row in results) for name in names}
    return {"tasks": {}, "mean_score": None, "samples": len(results), "costs": costs}


class StreamTrialWorker(TrialWorker):
    """Loads the model and the texts once in ``__init__``; ``evaluate_batch`` streams them under trials' presses.

    Parameters
    ----------
    stream_config : dict
        ``StreamConfig.to_dict()`` of the sweep (``SweepConfig.stream_config``); each trial replaces its press and
        sizes (``StreamConfig.with_press``).
    test_samples : int
        Texts (per task for ``stream_answer``) held out for the test stage.
    """

    def __init__(self, stream_config: dict, test_samples: int = 0):
        import transformers

        transformers.utils.logging.disable_progress_bar()  # a worker's log is no terminal
        self.config = StreamConfig.from_dict(stream_config)
        check_device(self.config.device)
        self.loaded = load_model(self.config.model, dtype=self.config.dtype, device=self.config.device)
        self.model_dtype = self.loaded.dtype_name
        self.samples = stage_items(self.config, test_samples, self.loaded.tokenizer)
        self.sample_total = len(self.samples[FULL_STAGE]) + len(self.samples[TEST_STAGE])
        self.model_loads = 1
        self.trials_evaluated = 0

    def _evaluate(self, requests: list[TrialRequest]) -> list[TrialOutcome]:
        started = time.time()
        items = self.samples[requests[0].stage]
        configs = [self._stage_config(request) for request in requests]
        presses = [BuiltPress.of(config.bounded_press) for config in configs]
        stores = [self._store(request, config) for request, config in zip(requests, configs)]
        done = [dict(store.results) if store else {} for store in stores]
        resumed = [sum(item.item_id in found for item in items) for found in done]
        for item in items:
            reference = None
            for config, press, store, found in zip(configs, presses, stores, done):
                if item.item_id in found:
                    continue
                found[item.item_id], reference = evaluate_stream_item(self.loaded, item, config, press.press, reference)
                if store is not None:
                    store.add(found[item.item_id])
        evaluated = []
        for found in done:
            results = [found[item.item_id] for item in items]
            samples = [
                {
                    "sample_id": item.item_id,
                    "task": item.task,
                    "predictions": [],
                    "scores": [],
                    **{METRIC_NAMES.get(name, name): value for name, value in result.items() if name != "item_id"},
                }
                for item, result in zip(items, results)
            ]
            evaluated.append(dict(summary=stream_summary(results), samples=samples))
        return self._finished(requests, started, presses, evaluated, resumed)

    def _store(self, request: TrialRequest, config: StreamConfig) -> StreamStore | None:
        """The store of a request's per-text results (JSON lines at ``TrialRequest.checkpoint``), or None."""
        path = self._checkpoint_path(request)
        return StreamStore(path, config) if path is not None else None

    def _stage_config(self, request: TrialRequest) -> StreamConfig:
        """The evaluation a request runs: its press and sizes, on the test split's texts in the test stage."""
        split = "eval" if request.stage == TEST_STAGE and self.config.protocol == STREAM_NLL else self.config.split
        return replace(self.config.with_press(request.press), split=split)
