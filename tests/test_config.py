"""The configuration spine: every GRKV option is defined once and reachable from the CLI and a sweep config."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from grkv_core.catalog import MERGERS, merger_option_defaults, merger_option_names, merger_option_specs, mergers_taking
from grkv_core.config import EvalConfig, PressConfig
from grkv_core.metrics import (
    ANSWER,
    ANSWER_METRICS,
    BENCHMARK,
    COST,
    HIGHER_IS_BETTER,
    LOSS_METRICS,
    METRICS,
    OBJECTIVE_METRICS,
    RECONSTRUCTION,
    SAMPLE_MEAN,
    SAMPLE_MEAN_METRICS,
    SCREENING_METRICS,
    STREAM,
    STREAM_METRICS,
    TASK_MEAN,
)
from grkv_core.options import (
    GRKV_DEFAULTS,
    GRKV_OPTION_SPECS,
    PAPER_GRKV_OPTIONS,
    GRKVOptions,
    OptionSpec,
    check_options,
)
from grkv_core.presses.from_config import build
from sweeps.config import ConfigError, Objective, SweepConfig, load_config
from workers.names import BASELINE_TAG

REPO = Path(__file__).resolve().parents[1]


# Every option of every merger, as (merger, option).
MERGER_OPTIONS_WALK = [(merge, name) for merge in MERGERS for name in merger_option_specs(merge)]


def a_value_other_than_the_default(merge: str, name: str):
    """A value the option accepts that differs from the default of the press the merger builds, so reaching the
    press is observable."""
    spec = merger_option_specs(merge)[name]
    default = getattr(build(PressConfig("snapkv", 0.9, merge)), name)
    if spec.kind is bool:
        value = not default
    elif spec.kind is str:
        value = next(choice for choice in spec.choices if choice != default)
    elif spec.kind is int:
        value = 2 if default is None else default + 1
    else:
        value = 0.5 if default in (None, 0) else default / 2
    assert spec.accepts(value) and value != default
    return value


def test_the_config_modules_load_no_heavy_package():
    code = (
        "import sys, grkv_core.config, grkv_core.evaluation.kvpress_layout, sweeps.config; "
        "print(sorted(m for m in ('torch', 'kvpress', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


def test_every_metric_is_defined_once_and_the_metric_tuples_are_views_of_the_table():
    names = [spec.name for spec in METRICS]
    assert len(names) == len(set(names))
    # NOTE: read from the source, so a metric's name typed into a tuple of its own again is caught.
    literals = Counter(
        node.value
        for module in ("metrics.py", "config.py")
        for node in ast.walk(ast.parse((REPO / "grkv_core" / module).read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    )
    assert {name: literals[name] for name in names} == dict.fromkeys(names, 1)
    assert all(spec.family in (BENCHMARK, ANSWER, RECONSTRUCTION, STREAM, COST) for spec in METRICS)
    assert STREAM_METRICS == tuple(spec.name for spec in METRICS if spec.family == STREAM)
    assert all(spec.summary in (SAMPLE_MEAN, TASK_MEAN, None) for spec in METRICS)
    assert SAMPLE_MEAN_METRICS == tuple(
        spec.name for spec in METRICS if spec.summary == SAMPLE_MEAN and spec.name not in STREAM_METRICS
    )
    assert ANSWER_METRICS == ("answer_nll", "answer_kl", "answer_top1")
    assert LOSS_METRICS == ("window_loss", "heldout_loss", "question_loss")
    assert HIGHER_IS_BETTER == {"score", "mean_score", "mean_score_outside_window", "answer_top1"}
    assert SCREENING_METRICS == ("answer_nll", "answer_kl", "window_loss", "question_loss")
    assert OBJECTIVE_METRICS == (
        "mean_score",
        *ANSWER_METRICS,
        *LOSS_METRICS,
        *STREAM_METRICS,
        "ttft_s",
        "decode_ms_per_token",
        "kv_bytes",
    )


@pytest.mark.parametrize("metric", OBJECTIVE_METRICS)
def test_a_sweep_takes_each_objectives_direction_from_the_table(metric):
    better = "maximize" if metric in HIGHER_IS_BETTER else "minimize"
    assert Objective.model_validate({"metric": metric}).direction == better
    other = "minimize" if better == "maximize" else "maximize"
    with pytest.raises(ValueError, match=f"direction must be {better}"):
        Objective.model_validate({"metric": metric, "direction": other})


def test_every_catalog_entry_loads_what_it_names():
    from kvpress import BasePress

    from grkv_core.catalog import EVICTION_PRESSES, QUERY_POLICIES

    for name, entry in EVICTION_PRESSES.items():
        assert isinstance(entry.load()(compression_ratio=0.5), BasePress), name
    for name, entry in MERGERS.items():
        assert issubclass(entry.load(), BasePress), name
    for name, entry in QUERY_POLICIES.items():
        assert entry.load().name == name


def test_grkv_press_fields_are_exactly_the_options():
    from dataclasses import fields

    from grkv_core.presses.grkv import GRKVPress

    press_fields = {f.name: f.default for f in fields(GRKVPress)}
    assert {name: press_fields[name] for name in GRKV_OPTION_SPECS} == GRKV_DEFAULTS
    assert set(press_fields) - set(GRKV_OPTION_SPECS) == {"press", "compression_ratio"}  # the base press, its budget


@pytest.mark.parametrize("merge, name", MERGER_OPTIONS_WALK)
def test_every_option_of_every_merger_is_settable_from_the_cli(merge, name):
    from grkv_core.cli import build_parser
    from grkv_core.merger_flags import merge_options

    value = a_value_other_than_the_default(merge, name)
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        arguments = [flag if value else "--no-" + flag[2:]]
    else:
        arguments = [flag, str(value)]
    options = merge_options(build_parser().parse_args(["eval", "--merge", merge, *arguments]), merge)
    assert options == {name: value}
    assert getattr(build(PressConfig("snapkv", 0.9, merge, options)), name) == value


@pytest.mark.parametrize("merge, name", MERGER_OPTIONS_WALK)
def test_every_option_of_every_merger_is_settable_from_a_sweep_config(merge, name):
    from sweeps.space import suggest_press

    value = a_value_other_than_the_default(merge, name)
    config = SweepConfig(
        name="walk", trials=1, merge=[merge], search_space={name: {"type": "categorical", "choices": [value]}}
    )
    study = optuna.create_study()
    press_config = suggest_press(study.ask(), config)
    assert press_config.merge_options == {name: value}
    assert getattr(build(press_config), name) == value


def test_an_option_the_chosen_merger_does_not_take_is_refused_on_the_command_line_and_in_a_sweep():
    from grkv_core.cli import build_parser
    from grkv_core.merger_flags import merge_options

    with pytest.raises(ValueError, match=r"^--merge d2o takes no --beta \(options of grkv\)$"):
        merge_options(build_parser().parse_args(["eval", "--merge", "d2o", "--beta", "0.2"]), "d2o")
    with pytest.raises(ValueError, match=r"search_space.sigma: an option of \['kvmerger'\], none of them"):
        SweepConfig(
            name="walk", trials=1, merge=["grkv"], search_space={"sigma": {"type": "float", "low": 0.1, "high": 1.0}}
        )


def test_an_option_two_mergers_share_means_one_kind_of_value():
    for name in merger_option_names():
        specs = [replace(merger_option_specs(merge)[name], help="", symbol=None) for merge in mergers_taking(name)]
        assert all(spec == specs[0] for spec in specs), name


@pytest.mark.parametrize("merge", list(MERGERS))
def test_every_merger_presses_fields_are_exactly_its_option_specs(merge):
    # kvpress's MergingPress included: its specs are declared by hand, so they must name exactly its fields.
    from dataclasses import fields

    press_fields = {
        item.name: item.default
        for item in fields(MERGERS[merge].load())
        if item.name not in ("press", "compression_ratio")
    }
    assert press_fields == merger_option_defaults(merge)


def test_unset_cli_flags_keep_the_press_defaults():
    from grkv_core.cli import build_parser
    from grkv_core.merger_flags import merge_options

    assert merge_options(build_parser().parse_args(["eval", "--merge", "grkv"]), "grkv") == {}


@pytest.mark.parametrize(
    "name, param, problem",
    [
        ("components", {"type": "categorical", "choices": ["kv", "kq"]}, "choice(s) ['kq'] rejected"),
        ("window_size", {"type": "float", "low": 8.0, "high": 64.0}, "type: float cannot set it"),
        ("safeguard", {"type": "int", "low": 0, "high": 1}, "type: int cannot set it"),
        ("beta", {"type": "float", "low": 0.0, "high": 1.5}, "bound(s) [1.5] rejected"),
        ("max_rel_update_k", {"type": "float", "low": 0.01, "high": 0.1, "include_zero": True}, "bound(s) [0.0]"),
        ("compression_ratio", {"type": "float", "low": 0.5, "high": 1.0}, "bound(s) [1.0] rejected"),
    ],
)
def test_a_search_space_the_options_reject_is_a_one_line_error(tmp_path, name, param, problem):
    path = tmp_path / "sweep.yaml"
    path.write_text(f"name: bad\ntrials: 1\nsearch_space:\n  {name}: {param}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    message = str(raised.value)
    assert f"search_space.{name}: {problem}" in message and "\n" not in message


def test_the_paper_baseline_skips_what_a_searched_parameter_cannot_express():
    from sweeps.space import baseline_params

    config = SweepConfig(
        name="caps",
        trials=1,
        search_space={
            "max_rel_update_k": {"type": "float", "low": 0.01, "high": 0.1},
            "cg_max_iter": {"type": "int", "low": 1, "high": 8},
            "safeguard": {"type": "categorical", "choices": [True, False]},
        },
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paper = dict(baseline_params(config))["paper_default"]
    assert paper == {"merge": "grkv", "cg_max_iter": PAPER_GRKV_OPTIONS["cg_max_iter"], "safeguard": False}
    assert any("max_rel_update_k=None" in str(warning.message) for warning in caught)


# The paper's Alg. 1 with its Sec. 4.1 settings, written out here apart from the code: surrogate queries are the last
# 32 prompt tokens, λ_k = λ_v = 1e-2, β = 0.1, the sinks and the window fixed, one alternating step, keys and values,
# the key step's conjugate gradients to convergence, no safeguard, cap, acceptance rule or row weights, every layer.
ALG_1 = {
    "lambda_k": 1e-2,
    "lambda_v": 1e-2,
    "beta": 0.1,
    "window_size": 32,
    "steps": 1,
    "n_sink": 4,
    "fix_window": True,
    "components": "kv",
    "query_policy": "window",
    "max_rel_update_k": None,
    "max_rel_update_v": None,
    "accept": "always",
    "cg_max_iter": 200,
    "cg_rtol": 1e-7,
    "safeguard": False,
    "ridge_scale": "absolute",
    "head_weighting": "uniform",
    "merged_layers": "all",
}
# How the work is batched, not what is computed: the same results up to float rounding.
BATCHING = {"layers_per_solve", "target_from_forward", "merge_stream"}


def test_the_paper_preset_is_alg_1_exactly_whatever_the_defaults():
    from kvpress import SnapKVPress

    from grkv_core.cli import _eval_press, build_parser
    from grkv_core.presses.grkv import GRKVPress

    assert set(ALG_1) | BATCHING == set(GRKV_OPTION_SPECS)
    assert {name: PAPER_GRKV_OPTIONS[name] for name in ALG_1} == ALG_1
    base = SnapKVPress(compression_ratio=0.8)
    press = GRKVPress.paper(base)
    assert press.press is base and {name: getattr(press, name) for name in ALG_1} == ALG_1
    assert GRKVPress.paper(base, beta=0.3).beta == 0.3
    from_cli, _ = _eval_press(build_parser().parse_args(["eval", "--merge", "grkv", "--preset", "paper"]))
    built = build(from_cli)
    assert {name: getattr(built, name) for name in ALG_1} == ALG_1
    overridden, _ = _eval_press(build_parser().parse_args(["eval", "--preset", "paper", "--lambda-k", "0.1"]))
    assert overridden.merge_options == {**PAPER_GRKV_OPTIONS, "lambda_k": 0.1}


def test_a_preset_with_another_merger_is_refused():
    from grkv_core.cli import build_parser
    from grkv_core.merger_flags import merge_options

    with pytest.raises(ValueError, match=r"^--preset paper is a set of GRKV's options; --merge cam takes none$"):
        merge_options(build_parser().parse_args(["eval", "--merge", "cam", "--preset", "paper"]), "cam")


@pytest.mark.parametrize(
    "value, accepted",
    [
        (0.0, True),
        (1.0, True),
        (0.5, True),
        (1.5, False),
        (-0.1, False),
        (float("nan"), False),
        (True, False),
        ("0.5", False),
        (None, False),
    ],
)
def test_a_closed_float_range_accepts_exactly_its_numbers(value, accepted):
    assert OptionSpec("", float, low=0.0, high=1.0).accepts(value) is accepted


def test_options_name_the_first_rejected_field():
    with pytest.raises(ValueError, match=r"^steps must be an integer >= 1, got 0$"):
        check_options(GRKVOptions(steps=0))
    with pytest.raises(ValueError, match=r"^max_rel_update_v must be None or a finite number > 0, got 0$"):
        check_options(GRKVOptions(max_rel_update_v=0))


def test_eval_config_round_trips_and_reads_the_loss_window_of_older_result_files():
    config = EvalConfig(
        tasks=("niah_single_1",), press=PressConfig("snapkv", 0.8, "grkv", {"window_size": 16}), loss_window=24
    )
    assert EvalConfig.from_dict(config.to_dict()) == config
    legacy = {key: value for key, value in config.to_dict().items() if key != "loss_window"}
    assert EvalConfig.from_dict({**legacy, "window_size": 24}) == config
    with pytest.raises(ValueError, match="unknown evaluation config field"):
        EvalConfig.from_dict({**legacy, "windowsize": 24})


def test_eviction_only_is_a_fixed_baseline_whatever_the_merge_choices():
    from sweeps.space import baseline_params, suggest_press

    for merge in (["grkv"], ["grkv", "none"]):
        config = SweepConfig(name="baselines", trials=3, merge=merge, search_space={})
        assert config.baselines == ["paper_default", "eviction_only", "library_default"]
        study = optuna.create_study()
        for name, params in baseline_params(config):
            study.enqueue_trial(params, user_attrs={BASELINE_TAG: name})
        paper, eviction, library = (suggest_press(study.ask(), config) for _ in range(3))
        assert (paper.merge, eviction.merge, library.merge) == ("grkv", "none", "grkv")
        assert library == PressConfig(config.press.name, config.press.compression_ratio, "grkv")
        assert eviction == PressConfig(config.press.name, config.press.compression_ratio)


def test_grkv_press_documents_each_option_once_with_its_specs_help():
    from grkv_core.options import GRKV_OPTION_SPECS
    from grkv_core.presses.grkv import GRKVPress

    documentation = " ".join(GRKVPress.__doc__.split())
    for name, spec in GRKV_OPTION_SPECS.items():
        assert documentation.count(f" {name} : ") == 1, name
        assert " ".join(spec.help.split()) in documentation, name
