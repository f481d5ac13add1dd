"""The Ray actor that holds one loaded model and its evaluation samples, and evaluates many trials."""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import asdict
from functools import partial

import ray
import torch

from grkv_core.config import EvalConfig
from grkv_core.evaluate import EvaluationSetup, summarize
from workers.protocol import FAILED, OK, TrialOutcome, TrialRequest, WorkerIdentity


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
        self.setup = EvaluationSetup.load(EvalConfig.from_dict(eval_config))
        self.model_loads = 1
        self.trials_evaluated = 0

    def identity(self) -> WorkerIdentity:
        context = ray.get_runtime_context()
        return WorkerIdentity(pid=os.getpid(), node_id=context.get_node_id(), actor_id=context.get_actor_id(),
                              model_loads=self.model_loads, trials_evaluated=self.trials_evaluated,
                              samples=len(self.setup.samples))

    def evaluate(self, request: TrialRequest) -> TrialOutcome:
        """Evaluate one trial. Errors (including CUDA OOM) come back as a failed outcome, never raised."""
        started = time.time()
        failed = partial(TrialOutcome, request.trial_number, FAILED, started_at=started, worker=self.identity())
        try:
            resolved = request.press.resolved()
            results = [self.setup.evaluator.evaluate_sample(sample, request.press) for sample in self.setup.samples]
        except torch.cuda.OutOfMemoryError as error:
            torch.cuda.empty_cache()
            return failed(error=f"CUDA out of memory: {error}", finished_at=time.time())
        except Exception as error:  # noqa: BLE001 - a trial's failure must not take the worker down
            return failed(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc(),
                          finished_at=time.time())
        self.trials_evaluated += 1
        return TrialOutcome(request.trial_number, OK, started_at=started, finished_at=time.time(),
                            worker=self.identity(), resolved_press=resolved, summary=summarize(results),
                            samples=[asdict(result) for result in results])
