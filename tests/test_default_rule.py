"""``benchmarks/default_rule.py``: Holm's correction against its definition, and the rule's verdict on result folders
built with known effects."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from benchmarks.default_rule import (
    BASE_PRESSES,
    PROTOCOLS,
    SAMPLES_PER_CELL,
    PairedTest,
    choose,
    holm,
    report,
    standing,
)
from grkv_core.merger_flags import parse_merge_variant
from grkv_core.options import GRKV_DEFAULTS, WINDOW32_GRKV_OPTIONS


def holm_by_definition(p_values):
    """p_i adjusted = max over the p_j ranked at or before p_i of min(1, (m − rank_j)·p_j)."""
    m = len(p_values)
    ranked = sorted(p_values)
    return [max(min(1.0, (m - rank) * ranked[rank]) for rank in range(ranked.index(p) + 1)) for p in p_values]


@pytest.mark.parametrize("seed", range(5))
def test_holm_matches_its_definition(seed):
    p_values = list(np.random.default_rng(seed).uniform(0, 0.05, size=12))
    assert holm(p_values) == pytest.approx(holm_by_definition(p_values))


def with_effects(cells_effects):
    """Tests with the given (answer NLL difference, p) per cell; the KL level in every cell."""
    tests = []
    for cell, (difference, p) in cells_effects.items():
        tests.append(PairedTest(cell, "answer_nll", 80, difference, difference - 0.01, difference + 0.01, p))
        tests.append(PairedTest(cell, "answer_kl", 80, 0.0, -0.01, 0.01, 0.9))
    return tests


CELLS = [f"cell {index}" for index in range(4)]


def test_the_rule_passes_the_largest_gain_and_breaks_ties_by_prefill_cost():
    harmful = standing("harmful", with_effects({c: (-0.05, 1e-6) for c in CELLS[:3]} | {CELLS[3]: (0.01, 1e-6)}), 1.0)
    dear = standing("dear", with_effects({c: (-0.020, 1e-6) for c in CELLS}), 1.5)
    cheap = standing("cheap", with_effects({c: (-0.019, 1e-6) for c in CELLS}), 1.1)
    narrow = standing("narrow", with_effects({CELLS[0]: (-0.03, 1e-6)} | {c: (0.0, 0.9) for c in CELLS[1:]}), 1.0)
    assert harmful.worse_cells() == {CELLS[3]} and len(narrow.better_cells()) == 1
    pick, why = choose([harmful, dear, cheap, narrow], len(CELLS))
    assert pick.name == "cheap" and why.startswith("passes")


def test_without_a_passing_candidate_the_default_is_the_best_harmless_one():
    harmful = standing("harmful", with_effects({c: (-0.05, 1e-6) for c in CELLS[:3]} | {CELLS[3]: (0.01, 1e-6)}), 1.0)
    narrow = standing("narrow", with_effects({CELLS[0]: (-0.03, 1e-6)} | {c: (0.0, 0.9) for c in CELLS[1:]}), 1.0)
    level = standing("level", with_effects({c: (-0.001, 0.5) for c in CELLS}), 1.0)
    pick, why = choose([harmful, narrow, level], len(CELLS))
    assert pick.name == "narrow" and "no-harm" in why
    pick, why = choose([harmful], len(CELLS))
    assert pick.name == "harmful" and "fewest" in why


def write_cell(folder, press, effects, samples, rng):
    """A base press's results and its candidates', whose answer NLL differs by ``effects[name]`` plus noise."""
    folder.mkdir(parents=True, exist_ok=True)
    base = [
        {"sample_id": f"s{i}", "answer_nll": 2.0 + rng.normal(), "answer_kl": 1.0 + rng.normal(), "prefill_s": 1.0}
        for i in range(samples)
    ]
    (folder / f"{press}.json").write_text(json.dumps({"samples": base}))
    for name, effect in effects.items():
        rows = [
            {
                **row,
                "answer_nll": row["answer_nll"] + effect + 0.01 * rng.normal(),
                "answer_kl": row["answer_kl"] + 0.01 * rng.normal(),
                "prefill_s": 1.2,
            }
            for row in base
        ]
        (folder / f"{press}+{name}.json").write_text(json.dumps({"samples": rows}))


def test_the_report_gives_a_verdict_only_once_every_cell_has_its_samples(tmp_path):
    rng = np.random.default_rng(0)
    for model, samples in SAMPLES_PER_CELL.items():
        for protocol in PROTOCOLS:
            for press in BASE_PRESSES:
                harmed = model == "gemma3-270m" and press == "snapkv-50pct"
                effects = {"helps": -0.05, "harms-once": 0.05 if harmed else -0.08}
                short = model == "gemma3-270m" and protocol == "query_aware" and press == "pyramidkv-20pct"
                write_cell(tmp_path / model / protocol, press, effects, samples - 1 if short else samples, rng)
    text = report(tmp_path)
    assert "No verdict: 1 of 16 cells lack samples" in text and "Verdict" not in text.replace("No verdict", "")
    write_cell(
        tmp_path / "gemma3-270m" / "query_aware", "pyramidkv-20pct", {"helps": -0.05, "harms-once": -0.08}, 40, rng
    )
    text = report(tmp_path)
    assert text.endswith("Verdict: **helps** (passes: worse in no cell, better in at least half).")
    # NOTE: the larger mean gain, but worse in both of Gemma's 50% cells.
    assert "| harms-once | +0.06" in text and "| 14 | 2 | 1.200 |" in text


REPO = Path(__file__).resolve().parents[1]
# The verdict docs/results/default-rule.md records (2026-11-28), which the library's defaults are.
RULE_VERDICT = "sweep-qag2"


def rule_candidates() -> dict[str, dict]:
    """``benchmarks/default_rule.sh``'s candidates as bash expands them, ``{name: options}``."""
    script = (REPO / "benchmarks" / "default_rule.sh").read_text()
    block = script[script.index("\nbase=") : script.index("\n)\n") + 3]
    expanded = subprocess.run(
        ["bash", "-c", block + 'printf "%s\\n" "${candidates[@]}"'], capture_output=True, text=True, check=True
    ).stdout
    return {name: options for name, _, options in map(parse_merge_variant, expanded.splitlines())}


def test_grkv_press_with_no_options_builds_the_rules_choice_and_the_window32_preset_its_old_default():
    from kvpress import SnapKVPress

    from grkv_core import GRKVPress

    candidates = rule_candidates()
    assert len(candidates) == 8 and RULE_VERDICT in candidates
    # What a candidate leaves out stayed at the defaults of the rule's date: the window32 preset.
    chosen = {**WINDOW32_GRKV_OPTIONS, **candidates[RULE_VERDICT]}
    press = GRKVPress(SnapKVPress(compression_ratio=0.8))
    assert {name: getattr(press, name) for name in GRKV_DEFAULTS} == chosen
    assert {**WINDOW32_GRKV_OPTIONS, **candidates["window32"]} == WINDOW32_GRKV_OPTIONS


@pytest.mark.slow
def test_the_committed_results_give_the_verdict_the_defaults_follow():
    text = report(REPO / "benchmarks" / "results" / "default-rule")
    assert f"Verdict: **{RULE_VERDICT}** (" in text
