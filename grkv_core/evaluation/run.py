"""An evaluation config end to end: its model and samples loaded once (``EvaluationSetup``), every press's samples
evaluated with one shared prefill each, resumed from and written to result files (``run_evaluations``), and
optionally in kvpress's evaluation layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from grkv_core.config import EvalConfig
from grkv_core.datasets import EvalSample, load_dataset_samples
from grkv_core.evaluation.evaluator import Evaluator
from grkv_core.evaluation.kvpress_layout import kvpress_runs, write_run
from grkv_core.evaluation.results import ResultStore, SampleResult, library_versions, summarize
from grkv_core.models import LoadedModel, load_model
from grkv_core.presses.from_config import BuiltPress, required_attention


@dataclass
class EvaluationSetup:
    """What an evaluation config loads once and any number of presses then share: the model, the samples
    and an evaluator (the CLI's comparisons and every Ray worker use one for many configurations)."""

    loaded: LoadedModel
    samples: list[EvalSample]
    evaluator: Evaluator

    @classmethod
    def load(cls, config: EvalConfig) -> EvaluationSetup:
        """Load ``config``'s model (with the attention its press needs) and samples.

        NOTE: everything but ``config.press`` is used; the press of each evaluation is passed separately.
        """
        attention = config.attn_implementation or required_attention(config.press.press)
        loaded = load_model(config.model, dtype=config.dtype, attn_implementation=attention, device=config.device)
        samples = load_dataset_samples(
            config.dataset,
            tasks=config.tasks,
            context_length=config.context_length,
            samples_per_task=config.samples,
            seed=config.seed,
            data_dir=config.data_dir,
            tokenizer=loaded.tokenizer,
        )
        evaluator = Evaluator(
            loaded, loss_window=config.loss_window, heldout_tokens=config.heldout_tokens, protocol=config.protocol
        )
        return cls(loaded, samples, evaluator)

    @property
    def model_dtype(self) -> str:
        """The dtype the model loaded in (``"float32"``), as result files record it."""
        return self.loaded.dtype_name


def run_evaluation(
    config: EvalConfig,
    output: str | Path | None = None,
    *,
    setup: EvaluationSetup | None = None,
    progress: bool = True,
    kvpress_dir: str | Path | None = None,
) -> dict:
    """Evaluate ``config`` end to end; with ``output``, resume from and write to that JSON file.

    ``setup`` (loaded from a config that differs at most in its press) saves reloading the model and samples.
    With ``kvpress_dir``, the results are also written there in kvpress's evaluation layout
    (``grkv_core.evaluation.kvpress_layout``). Returns the summary dict (per-task scores, their mean, mean costs)
    with the config, versions and the kvpress folders written (``kvpress_folders``).
    """
    return run_evaluations([config], [output], setup=setup, progress=progress, kvpress_dir=kvpress_dir)[0]


def run_evaluations(
    configs: list[EvalConfig],
    outputs: list[str | Path | None],
    *,
    setup: EvaluationSetup | None = None,
    progress: bool = True,
    kvpress_dir: str | Path | None = None,
) -> list[dict]:
    """Evaluate several configurations (differing at most in their press) sample by sample, sharing each prefill.

    Each configuration resumes from and writes to its own output file (or None); a sample is evaluated for the
    configurations whose files lack it, all in one ``Evaluator.evaluate_trials``. Returns one summary per
    configuration, as ``run_evaluation`` (``kvpress_dir`` too).
    """
    if len(configs) != len(outputs):
        raise ValueError(f"{len(configs)} configurations but {len(outputs)} outputs")
    decode = configs[0].decode
    if any(config.decode != decode for config in configs):
        raise ValueError("configurations evaluated together either all decode or none does")
    if kvpress_dir is not None and not decode:
        raise ValueError("kvpress's evaluation layout holds predictions: decode (drop --no-decode) to write it")
    setup = setup or EvaluationSetup.load(configs[0])
    presses = [BuiltPress.of(config.press) for config in configs]
    stores = [
        ResultStore(Path(output), config, setup.model_dtype, press.settings) if output is not None else None
        for config, output, press in zip(configs, outputs, presses)
    ]
    label = configs[0].press.label if len(configs) == 1 else f"{len(configs)} configurations"
    results = evaluate_samples(
        setup.evaluator,
        setup.samples,
        presses,
        stores,
        decode=decode,
        progress=label if progress else None,
    )
    summaries = [
        {"config": config.to_dict(), "label": config.press.label, "versions": library_versions(), **summarize(rows)}
        for config, rows in zip(configs, results)
    ]
    if kvpress_dir is not None:
        for config, press, rows, summary in zip(configs, presses, results, summaries):
            runs = kvpress_runs(
                config,
                setup.samples,
                rows,
                str(press.press),
                {"summary": summary, "versions": summary["versions"]},
            )
            summary["kvpress_folders"] = [str(write_run(kvpress_dir, run)) for run in runs]
    return summaries


def evaluate_samples(
    evaluator: Evaluator,
    samples: list[EvalSample],
    presses: list[BuiltPress],
    stores: list[ResultStore | None],
    *,
    decode: bool = True,
    progress: str | None = None,
) -> list[list[SampleResult]]:
    """Every press's results on ``samples`` (in their order), sample by sample with one shared prefill each; each
    press built once (``BuiltPress``) serves every sample.

    Each press resumes from its store (or None): a sample is evaluated, in one ``Evaluator.evaluate_trials``,
    for the presses whose stores lack it, and each new result is added to its store at once, so an interrupted
    call loses at most the sample in progress. Results a store holds for other samples are left out.
    ``progress``: a progress bar's label (None: no bar).
    """
    order = {sample.sample_id: index for index, sample in enumerate(samples)}
    results = [
        [row for row in (store.results if store is not None else []) if row.sample_id in order] for store in stores
    ]
    done = [{row.sample_id for row in rows} for rows in results]
    pending = [sample for sample in samples if any(sample.sample_id not in ids for ids in done)]
    for sample in tqdm(pending, desc=progress, disable=progress is None, unit="sample"):
        todo = [index for index, ids in enumerate(done) if sample.sample_id not in ids]
        evaluated = evaluator.evaluate_trials(sample, [presses[index] for index in todo], decode=decode)
        for index, result in zip(todo, evaluated, strict=True):
            results[index].append(result)
            if stores[index] is not None:
                stores[index].add(result)
    return [sorted(rows, key=lambda row: order[row.sample_id]) for rows in results]
