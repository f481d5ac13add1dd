"""``grkv analyze``: carrier concentration of eviction presses under a local matching rule, and the plots.

For every sample, the context is prefilled once per eviction press with a recording press that asks the
base press for its kept set, matches each evicted token to a carrier with the local rule (by default the
paper's App. B rule: most key-cosine-similar kept token within a local candidate range), and leaves the
cache uncompressed. Units are sample-layer-KV-head, macro-averaged as in the paper.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from kvpress import BasePress
from tqdm.auto import tqdm

from grkv_core.catalog import EVICTION_PRESSES
from grkv_core.datasets import EvalSample
from grkv_core.diagnostics.carriers import CarrierConcentration, carrier_concentration_per_unit, macro_average
from grkv_core.diagnostics.plots import plot_cross_window_consistency, plot_merge_map
from grkv_core.diagnostics.windows import cross_window_similarity, window_output_summaries
from grkv_core.evaluation.generation import prefill, tokenize_sample
from grkv_core.models import LoadedModel
from grkv_core.presses.d2o import D2OPress
from grkv_core.presses.local_merging import MergeInputs
from grkv_core.presses.query_policies import surrogate_queries
from grkv_core.presses.selection import select_tokens


@dataclass
class _CarrierRecorder(BasePress):
    """Records (assignment, kept positions, keys) per layer for the base press; compresses nothing."""

    press: BasePress = None
    candidate_range: int = 32
    records: list = field(default_factory=list)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        selection = select_tokens(self.press, module, hidden_states, keys, values, attentions, kwargs)
        if selection.uniform_budget is None:
            raise ValueError("carrier analysis needs a uniform budget (not AdaKV-style per-head budgets)")
        inputs = MergeInputs.from_kept_mask(keys, values, selection.mask())
        rule = D2OPress(press=self.press, threshold=-1.0, candidate_range=self.candidate_range)
        assignment, _ = rule.most_similar_carrier(inputs)
        self.records.append((module.layer_idx, assignment.cpu(), inputs.kept.cpu(), keys.float().cpu()))
        return keys, values


@dataclass(frozen=True)
class CarrierReport:
    press: str
    macro: CarrierConcentration
    units: int


def carrier_report(
    loaded: LoadedModel,
    samples: list[EvalSample],
    press_name: str,
    compression_ratio: float,
    candidate_range: int = 32,
    plot_dir: Path | None = None,
    progress: bool = True,
) -> CarrierReport:
    """Macro-averaged carrier concentration of ``press_name`` over every sample-layer-head unit."""
    build_eviction = EVICTION_PRESSES.check(press_name).load()
    units = []
    for index, sample in enumerate(tqdm(samples, desc=f"carriers {press_name}", disable=not progress)):
        recorder = _CarrierRecorder(
            press=build_eviction(compression_ratio=compression_ratio), candidate_range=candidate_range
        )
        context_ids, _ = tokenize_sample(loaded.tokenizer, sample)
        prefill(loaded.model, context_ids, recorder)
        for layer, assignment, kept, keys in recorder.records:
            units.extend(carrier_concentration_per_unit(assignment, kept))
            if plot_dir is not None and index == 0 and layer == len(recorder.records) // 2:
                plot_merge_map(
                    plot_dir / f"merge_map_{press_name}_layer{layer}.png",
                    keys[0, 0],
                    kept[0, 0],
                    assignment[0, 0],
                    title=f"{press_name}: layer {layer}, KV head 0",
                )
    defined = [unit for unit in units if unit is not None]
    return CarrierReport(press=press_name, macro=macro_average(defined), units=len(defined))


def plot_window_consistency(
    loaded: LoadedModel, sample: EvalSample, path: Path, layer: int | None = None, window: int = 32
) -> Path:
    """Cross-window consistency heatmap of one layer, KV head 0, first query head of its group."""
    model = loaded.model
    layer = len(model.model.layers) // 2 if layer is None else layer
    captured = {}

    def hook(module, args, kwargs, output):
        hidden = kwargs["hidden_states"]
        captured["queries"] = surrogate_queries(
            module, hidden, kwargs["position_embeddings"], n_queries=hidden.shape[1]
        ).queries
        cache_layer = kwargs["past_key_values"].layers[module.layer_idx]
        captured["keys"], captured["values"] = cache_layer.keys, cache_layer.values
        captured["scale"] = module.scaling

    context_ids, _ = tokenize_sample(loaded.tokenizer, sample)
    handle = model.model.layers[layer].self_attn.register_forward_hook(hook, with_kwargs=True)
    try:
        prefill(model, context_ids)
    finally:
        handle.remove()
    length = context_ids.shape[1]
    queries = captured["queries"][0, 0, :length]
    summaries = window_output_summaries(
        queries, captured["keys"][0, 0], captured["values"][0, 0], window=window, scale=captured["scale"]
    )
    n_windows = summaries.shape[0]
    prompt_windows = min(max(1, int(0.9 * n_windows)), n_windows - 1) if n_windows > 1 else None
    return plot_cross_window_consistency(
        path,
        cross_window_similarity(summaries),
        prompt_windows=prompt_windows,
        title=f"cross-window consistency, layer {layer}, head 0",
    )


def format_carrier_table(reports: list[CarrierReport]) -> str:
    names = [f.name for f in fields(CarrierConcentration) if f.name not in ("n_units", "n_kept", "n_assigned")]
    header = ["press", "units", *names]
    rows = [
        [report.press, str(report.units), *(f"{asdict(report.macro)[name]:.3f}" for name in names)]
        for report in reports
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
