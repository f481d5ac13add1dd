"""The Ray actor that holds one loaded model and its evaluation samples, and evaluates many trials."""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import asdict

import ray
import torch

from grkv_core.config import EvalConfig, PressConfig
from grkv_core.evaluate import Evaluator, load_for, load_samples, summarize


@ray.remote
class TrialWorker:
    """Loads the model and the samples once in ``__init__``; ``evaluate`` runs one trial's press on them.

    Parameters
    ----------
    eval_config : dict
        ``EvalConfig.to_dict()`` of the sweep (model, data, dtype...); its press is replaced per trial.
    """

    def __init__(self, eval_config: dict):
        import transformers

        transformers.utils.logging.disable_progress_bar()  # a worker's log is no terminal
        self.base_config = EvalConfig.from_dict(eval_config)
        self.loaded = load_for(self.base_config)
        self.samples = load_samples(self.base_config, self.loaded.tokenizer)
        self.evaluator = Evaluator(self.loaded, loss_window=self.base_config.loss_window,
                                   heldout_tokens=self.base_config.heldout_tokens)
        self.model_loads = 1
        self.trials_evaluated = 0

    def identity(self) -> dict:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "actor_id": ray.get_runtime_context().get_actor_id(), "model_loads": self.model_loads,
                "trials_evaluated": self.trials_evaluated, "samples": len(self.samples)}

    def evaluate(self, trial_number: int, press: dict) -> dict:
        """Evaluate one trial. Errors (including CUDA OOM) come back as a failed result, never raised."""
        started = time.time()
        outcome = {"trial_number": trial_number, "started_at": started, "worker": self.identity()}
        try:
            press_config = PressConfig(**press)
            results = [self.evaluator.evaluate_sample(sample, press_config) for sample in self.samples]
        except torch.cuda.OutOfMemoryError as error:
            torch.cuda.empty_cache()
            return {**outcome, "status": "failed", "error": f"CUDA out of memory: {error}", "finished_at": time.time()}
        except Exception as error:  # noqa: BLE001 - a trial's failure must not take the worker down
            return {**outcome, "status": "failed", "error": f"{type(error).__name__}: {error}",
                    "traceback": traceback.format_exc(), "finished_at": time.time()}
        self.trials_evaluated += 1
        return {**outcome, "status": "ok", "summary": summarize(results), "samples": [asdict(r) for r in results],
                "finished_at": time.time()}
