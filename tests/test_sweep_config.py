"""Sweep configuration and stage planning without services: one-line config errors for batches, screening and
the test stage; the baselines at the sweep's budget; which trials are promoted and which are tested."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import warnings
from pathlib import Path

import optuna
import pytest
import yaml

from grkv_core.config import EvalConfig
from grkv_core.options import GRKV_DEFAULTS, GRKV_PRESETS, PAPER_GRKV_OPTIONS
from grkv_core.presses.from_config import resolved
from sweeps.config import ConfigError, SweepConfig, load_config
from sweeps.space import (
    baseline_params,
    make_sampler,
    one_at_a_time_params,
    press_of,
    proposing_at_random,
    suggest_press,
)
from sweeps.stages import best_trials, configuration_distance, presses_to_test, promotions
from workers.names import (
    BASELINE_TAG,
    DESIGN_ROW_ATTR,
    EVICTION_ONLY,
    LIBRARY_DEFAULT,
    PAPER_DEFAULT,
    PROMOTED_FROM_TAG,
)

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "sweeps" / "configs" / "smoke.yaml"


def smoke_with(tmp_path: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    """The smoke config with dotted fields changed (``"screening.promote": 5``) or dropped."""
    config = yaml.safe_load(SMOKE.read_text())
    for dotted, value in [*changes.items(), *((name, None) for name in drop)]:
        node = config
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if dotted in drop:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    "changes, drop, field",
    [
        ({"screening.promote": 5}, (), "screening.promote"),
        ({"screening.promote": 7, "screening.trials": 9}, (), "screening.promote"),  # 7 + 3 baselines > 8 trials
        ({"screening.metric": "mean_score"}, (), "screening.metric"),
        ({"screening.trials": -1}, (), "screening.trials"),
        ({"screening.min_distance": 1.5}, (), "screening.min_distance"),
        ({"test.min_distance": -0.1}, (), "test.min_distance"),
        ({"data.test.samples": -1}, (), "data.test.samples"),
        ({"workers.batch_size": 0}, (), "workers.batch_size"),
        ({"test.top_k": 0}, (), "test.top_k"),
        ({"test.eviction_ratios": [0.8]}, (), "test.eviction_ratios"),  # not a larger budget than 0.75
        ({"test.eviction_ratios": [1.5]}, (), "test.eviction_ratios"),
        ({"test.eviction_ratios": [0.5, 0.5]}, (), "test.eviction_ratios"),
        ({}, ("data.test",), "test.eviction_ratios"),  # eviction ratios but no held-out samples
        ({"test.mergers": ["none"]}, (), "test.mergers"),
        ({"test.mergers": ["cam", "cam"]}, (), "test.mergers"),
        ({"test.eviction_ratios": []}, ("data.test",), "test.mergers"),  # other mergers but no held-out samples
        (
            {"search_space.compression_ratio": {"type": "categorical", "choices": [0.5, 0.6]}},
            (),
            "press.compression_ratio",
        ),
    ],
)
def test_a_bad_stage_or_batch_field_is_one_line_naming_it(tmp_path, changes, drop, field):
    with pytest.raises(ConfigError) as raised:
        load_config(smoke_with(tmp_path, drop, **changes))
    message = str(raised.value)
    assert "\n" not in message and f": {field}:" in message, message


def test_the_command_line_reports_a_bad_screening_field_on_one_line(tmp_path):
    path = smoke_with(tmp_path, **{"screening.promote": 5})
    result = subprocess.run(
        [sys.executable, "sweep.py", "--config", str(path)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "screening.promote" in lines[0], result.stderr


def test_defaults_screen_nothing_test_nothing_and_batch_eight(tmp_path):
    config = load_config(smoke_with(tmp_path, drop=("screening", "test", "data.test", "workers.batch_size")))
    assert config.screening.trials == 0 and config.screening.metric == "question_loss"
    assert not config.test_stage and config.test.top_k == 3 and config.workers.batch_size == 8
    assert "K compressed caches plus one full cache" in type(config.workers).model_fields["batch_size"].description


def test_a_dumped_config_validates_again():
    config = load_config(SMOKE)
    assert SweepConfig.model_validate(config.model_dump(mode="json")) == config


def test_a_sweep_left_at_its_defaults_evaluates_the_librarys_defaults():
    """The model, data and press sections take ``EvalConfig``'s and ``PressConfig``'s defaults; only the device
    follows the workers (no GPU: cpu)."""
    config = SweepConfig(name="defaults", search_space={}, trials=1)
    assert config.eval_config() == EvalConfig(device="cpu")
    gpus = SweepConfig(name="gpus", search_space={}, trials=1, workers={"num_gpus": 1}, data={"dataset": "longbench"})
    assert gpus.eval_config() == EvalConfig(device="cuda", dataset="longbench", context_length=None)


def test_the_baselines_run_at_the_sweeps_budget_when_the_ratio_is_searched(tmp_path):
    config = load_config(
        smoke_with(tmp_path, **{"search_space.compression_ratio": {"type": "float", "low": 0.5, "high": 0.9}})
    )
    baselines = dict(baseline_params(config))
    assert baselines[EVICTION_ONLY] == {"compression_ratio": 0.75}
    assert baselines[PAPER_DEFAULT]["compression_ratio"] == 0.75
    eviction = press_of(baselines[EVICTION_ONLY], config, {BASELINE_TAG: EVICTION_ONLY})
    assert (eviction.compression_ratio, eviction.merge) == (0.75, "none")
    assert resolved(eviction)["compression_ratio"] == 0.75
    # Proposed through Optuna, as the driver enqueues it.
    study = optuna.create_study()
    study.enqueue_trial(baselines[EVICTION_ONLY], user_attrs={BASELINE_TAG: EVICTION_ONLY})
    proposed = suggest_press(study.ask(), config)
    assert (proposed.compression_ratio, proposed.merge) == (0.75, "none")


def add(study: optuna.Study, params: dict, values, **user_attrs) -> None:
    distributions = {name: optuna.distributions.CategoricalDistribution([value]) for name, value in params.items()}
    study.add_trial(
        optuna.trial.create_trial(params=params, distributions=distributions, values=values, user_attrs=user_attrs)
    )


def grkv(lambda_k: float) -> dict:
    return {
        "merge": "grkv",
        "lambda_k_is_zero": False,
        "lambda_k": lambda_k,
        "lambda_v": 0.1,
        "beta": 0.1,
        "window_size": 16,
        "steps": 1,
        "components": "kv",
    }


def test_the_best_distinct_screened_configurations_are_promoted():
    screen = optuna.create_study(direction="minimize")
    for lambda_k, loss in [(0.1, 0.5), (0.2, 0.1), (0.3, 0.3), (0.2, 0.1)]:
        add(screen, grkv(lambda_k), [loss])
    promoted = promotions(screen, 2)
    assert [params["lambda_k"] for params, _ in promoted] == [0.2, 0.3]
    assert [attrs[PROMOTED_FROM_TAG] for _, attrs in promoted] == [1, 2]


def test_a_minimum_distance_keeps_near_copies_of_a_better_configuration_out():
    screen = optuna.create_study(direction="minimize")
    distributions = {
        "lambda_k": optuna.distributions.FloatDistribution(1e-4, 1.0, log=True),
        "beta": optuna.distributions.FloatDistribution(0.0, 0.5),
        "query_policy": optuna.distributions.CategoricalDistribution(["window", "stratified"]),
    }
    for lambda_k, beta, policy, loss in [
        (1e-2, 0.1, "window", 0.1),
        (1.1e-2, 0.11, "window", 0.2),
        (1e-2, 0.1, "stratified", 0.3),
        (1e-2, 0.2, "window", 0.4),
        (1e-3, 0.1, "window", 0.5),
    ]:
        screen.add_trial(
            optuna.trial.create_trial(
                params={"lambda_k": lambda_k, "beta": beta, "query_policy": policy},
                distributions=distributions,
                values=[loss],
            )
        )
    trials = screen.get_trials()
    # log10(1.1) / 4 decades = 0.010 for lambda_k, 0.01 / 0.5 = 0.02 for beta: the larger counts.
    assert configuration_distance(trials[0], trials[1]) == pytest.approx(0.02)
    assert configuration_distance(trials[0], trials[2]) == 1.0  # another categorical choice
    assert configuration_distance(trials[0], trials[4]) == pytest.approx(0.25)  # one decade of four
    assert [attrs[PROMOTED_FROM_TAG] for _, attrs in promotions(screen, 3)] == [0, 1, 2]
    assert [attrs[PROMOTED_FROM_TAG] for _, attrs in promotions(screen, 3, min_distance=0.1)] == [0, 2, 3]
    assert [attrs[PROMOTED_FROM_TAG] for _, attrs in promotions(screen, 3, min_distance=0.21)] == [0, 2, 4]


def test_the_test_stage_tests_the_best_trials_the_baselines_and_larger_budgets(tmp_path):
    config = load_config(SMOKE)  # one objective (mean_score, maximised), top_k 2, eviction ratio 0.5, kvpress's
    study = optuna.create_study(direction="maximize")
    add(study, grkv(0.01), [90.0], **{BASELINE_TAG: PAPER_DEFAULT})
    add(study, {"merge": "none"}, [80.0], **{BASELINE_TAG: EVICTION_ONLY})
    for lambda_k, score in [(0.1, 50.0), (0.2, 70.0), (0.3, 60.0), (0.2, 70.0)]:
        add(study, grkv(lambda_k), [score])
    assert [trial.number for trial in best_trials(study, config)] == [3, 4]  # baselines and duplicate left out
    presses = dict(presses_to_test(study, config))
    assert list(presses) == ["3", "4", PAPER_DEFAULT, EVICTION_ONLY, "eviction_only@0.5", "kvpress_merging"]
    assert presses["3"].merge_options["lambda_k"] == 0.2
    assert presses[PAPER_DEFAULT].merge_options["lambda_k"] == 0.01
    assert (presses[EVICTION_ONLY].merge, presses[EVICTION_ONLY].compression_ratio) == ("none", 0.75)
    assert (presses["eviction_only@0.5"].merge, presses["eviction_only@0.5"].compression_ratio) == ("none", 0.5)
    merging = presses["kvpress_merging"]
    assert (merging.press, merging.compression_ratio, merging.merge, merging.merge_options) == (
        "snapkv",
        0.75,
        "kvpress_merging",
        {},
    )


def test_several_objectives_test_the_pareto_set(tmp_path):
    config = load_config(
        smoke_with(
            tmp_path,
            **{
                "test.top_k": 5,
                "objectives": [
                    {"metric": "mean_score", "direction": "maximize"},
                    {"metric": "window_loss", "direction": "minimize"},
                ],
            },
        )
    )
    study = optuna.create_study(directions=["maximize", "minimize"])
    for lambda_k, values in [(0.1, [50.0, 0.01]), (0.2, [70.0, 0.3]), (0.3, [40.0, 0.2]), (0.4, [60.0, 0.05])]:
        add(study, grkv(lambda_k), values)
    assert [trial.number for trial in best_trials(study, config)] == [1, 3, 0]  # trial 2 is dominated by trial 0


def proposals_of_eviction_only(study: optuna.Study, config: SweepConfig, asks: int, at_random: bool) -> int:
    """How many of ``asks`` proposals are ``merge: none``, told as the ledger tells them: the first evaluated
    (scoring best), every later one failed as a duplicate."""
    count = 0
    for _ in range(asks):
        with proposing_at_random(study, seed=len(study.trials)) if at_random else contextlib.nullcontext():
            trial = study.ask()
            press = suggest_press(trial, config)
        if press.merge == "none":
            count += 1
            evaluated = any(
                t.params.get("merge") == "none" and t.state == optuna.trial.TrialState.COMPLETE
                for t in study.get_trials(deepcopy=False)
            )
            if evaluated:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                continue
            study.tell(trial, [100.0])
        else:
            study.tell(trial, [10.0 + trial.params["beta"]])
    return count


def test_a_sampler_stuck_on_an_evaluated_choice_is_unstuck_by_random_proposals(tmp_path):
    """TPE on ``merge: [grkv, none]`` once eviction-only scores best proposes it nearly every time (the sweep
    saw 100 in a row and ended the stage at half its budget); the ledger's random proposals find new
    configurations, and the study gets its own sampler back."""
    config = load_config(smoke_with(tmp_path, merge=["grkv", "none"]))
    study = optuna.create_study(direction="maximize", sampler=make_sampler(config, seed=0))
    proposals_of_eviction_only(study, config, asks=20, at_random=False)
    tpe = proposals_of_eviction_only(study, config, asks=40, at_random=False)
    random = proposals_of_eviction_only(study, config, asks=40, at_random=True)
    print(f"merge=none proposed: TPE {tpe}/40, at random {random}/40")
    assert tpe >= 30, "the situation the fallback is for: TPE stuck on the evaluated choice"
    assert 8 <= random <= 32, "a random proposal picks either choice"
    assert isinstance(study.sampler, optuna.samplers.TPESampler)


def test_the_ablation_config_is_the_papers_table_one_factor_at_a_time():
    config = load_config(REPO / "sweeps/configs/ablation.yaml")
    changes = config.one_at_a_time_rows()
    assert changes == [
        {"lambda_k": 0.0, "lambda_v": 0.0},
        {"lambda_k": 0.1, "lambda_v": 0.1},
        {"lambda_k": 1.0, "lambda_v": 1.0},
        {"beta": 0.0},
        {"beta": 0.2},
        {"beta": 0.3},
        {"steps": 2},
        {"steps": 3},
        {"window_size": 48},
        {"window_size": 64},
        {"n_sink": 0},
        {"fix_window": False},
        {"components": "k"},
        {"components": "v"},
    ]
    paper = resolved(press_of(dict(baseline_params(config))[PAPER_DEFAULT], config, {BASELINE_TAG: PAPER_DEFAULT}))
    assert {name: paper[name] for name in PAPER_GRKV_OPTIONS} == PAPER_GRKV_OPTIONS
    for row_number, (change, params) in enumerate(zip(changes, one_at_a_time_params(config))):
        row = resolved(press_of(params, config, {DESIGN_ROW_ATTR: row_number}))
        assert {name: value for name, value in row.items() if paper[name] != value} == change


def test_the_paper_baseline_runs_alg_1_in_every_option_the_sweep_does_not_search(tmp_path):
    """A sweep searching only the ridges: its paper-default trial runs them at the paper's values and the rest of
    Alg. 1 (no safeguard, CG to convergence) as well, where an ordinary trial keeps GRKVPress's defaults; a
    categorical choice of ``null`` lets the baseline run the paper's uncapped step."""
    config = load_config(
        smoke_with(
            tmp_path,
            search_space={
                "lambda_k": {"type": "float", "low": 1e-3, "high": 1.0, "log": True},
                "max_rel_update_k": {"type": "categorical", "choices": [0.025, None]},
            },
        )
    )
    paper_params = dict(baseline_params(config))[PAPER_DEFAULT]
    paper = resolved(press_of(paper_params, config, {BASELINE_TAG: PAPER_DEFAULT}))
    assert {name: paper[name] for name in PAPER_GRKV_OPTIONS} == PAPER_GRKV_OPTIONS
    ordinary = resolved(press_of(paper_params, config))
    unsearched = {name: value for name, value in GRKV_DEFAULTS.items() if name not in config.search_space}
    assert {name: ordinary[name] for name in unsearched} == unsearched
    assert (ordinary["lambda_k"], ordinary["max_rel_update_k"]) == (1e-2, None)
    assert ordinary["safeguard"] and ordinary["cg_max_iter"] < PAPER_GRKV_OPTIONS["cg_max_iter"]
    eviction = press_of(dict(baseline_params(config))[EVICTION_ONLY], config, {BASELINE_TAG: EVICTION_ONLY})
    assert eviction.merge == "none" and not eviction.merge_options


def test_a_sweep_starts_from_the_librarys_default_and_a_preset_replaces_it(tmp_path):
    """The library-default baseline runs ``GRKVPress``'s defaults, its searched options included (enqueued at
    them); with a ``preset``, every other trial takes the preset's values for what it does not search, and the
    baselines keep theirs."""
    space = {
        "lambda_k": {"type": "float", "low": 1e-3, "high": 1.0, "log": True},
        "query_policy": {"type": "categorical", "choices": ["window", "stratified", "mixture"]},
    }
    config = load_config(smoke_with(tmp_path, search_space=space))
    params = dict(baseline_params(config))
    assert list(params) == [PAPER_DEFAULT, EVICTION_ONLY, LIBRARY_DEFAULT]
    library = press_of(params[LIBRARY_DEFAULT], config, {BASELINE_TAG: LIBRARY_DEFAULT})
    assert {name: resolved(library)[name] for name in GRKV_DEFAULTS} == GRKV_DEFAULTS
    assert params[LIBRARY_DEFAULT]["query_policy"] == GRKV_DEFAULTS["query_policy"]

    preset = GRKV_PRESETS["window32"]
    with_preset = load_config(smoke_with(tmp_path, search_space=space, preset="window32"))
    proposal = {**params[LIBRARY_DEFAULT], "lambda_k": 0.5, "query_policy": "mixture"}
    ordinary = resolved(press_of(proposal, with_preset))
    assert {name: ordinary[name] for name in preset} == {**preset, "lambda_k": 0.5, "query_policy": "mixture"}
    for name, options in ((LIBRARY_DEFAULT, GRKV_DEFAULTS), (PAPER_DEFAULT, PAPER_GRKV_OPTIONS)):
        ran = resolved(press_of(dict(baseline_params(with_preset))[name], with_preset, {BASELINE_TAG: name}))
        assert {option: ran[option] for option in options} == options
    with pytest.raises(ConfigError, match="preset: window32 is a set of GRKV's options"):
        load_config(smoke_with(tmp_path, search_space={}, merge=["cam"], preset="window32"))


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"trials": 15}, "the one-at-a-time design has 14 rows plus 2 baseline(s); set trials: 16"),
        ({"search_space.steps.choices": [2, 3]}, "search_space.steps: one_at_a_time holds it at the paper default 1"),
        (
            {"search_space.lambda_v.choices": [0.01, 0.1]},
            "sampler.together: ['lambda_k', 'lambda_v'] are varied together",
        ),
        ({"baselines": ["eviction_only"]}, "it needs merge grkv, the paper_default baseline"),
        ({"search_space.beta": {"type": "float", "low": 0.0, "high": 0.3}}, "one_at_a_time needs every search_space"),
    ],
)
def test_a_one_at_a_time_design_that_cannot_be_run_is_refused_in_one_line(tmp_path, changes, problem):
    raw = yaml.safe_load((REPO / "sweeps/configs/ablation.yaml").read_text())
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert problem in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("path", sorted((REPO / "sweeps" / "configs").glob("*.yaml")), ids=lambda path: path.name)
def test_every_committed_sweep_config_is_valid(path):
    assert load_config(path).name


def test_the_hypotheses_sweep_anchors_on_the_papers_exact_alg_1():
    """Its caps can propose ``null`` (no cap), so the paper-default baseline is the paper's GRKV, no option drawn."""
    config = load_config(REPO / "sweeps/configs/ruler-snapkv-hypotheses.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = dict(baseline_params(config))[PAPER_DEFAULT]
    paper = resolved(press_of(params, config, {BASELINE_TAG: PAPER_DEFAULT}))
    assert {name: paper[name] for name in PAPER_GRKV_OPTIONS} == PAPER_GRKV_OPTIONS


def test_the_query_aware_answer_sweep_differs_from_the_agnostic_one_only_in_protocol_and_tuning_design():
    agnostic = yaml.safe_load((REPO / "sweeps/configs/ruler-snapkv-answer.yaml").read_text())
    query_aware = yaml.safe_load((REPO / "sweeps/configs/ruler-snapkv-answer-query-aware.yaml").read_text())
    assert query_aware["data"] == {**agnostic["data"], "protocol": "query_aware"}
    assert {key for key in agnostic.keys() | query_aware.keys() if agnostic.get(key) != query_aware.get(key)} == {
        "name",
        "data",
        "screening",
        "trials",
    }
    assert query_aware["screening"]["metric"] == "answer_nll" and query_aware["screening"]["trials"] >= 48
