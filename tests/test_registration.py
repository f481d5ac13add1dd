"""A merger is one class and one registration: defined here alone, it is a command-line choice with its options as
flags, a sweep config's merger with its options searchable, and a press the library builds and runs."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import optuna
import pytest
import torch
from conftest import tiny_model

from grkv_core.catalog import MERGERS
from grkv_core.cli import build_parser
from grkv_core.config import PressConfig
from grkv_core.evaluation.generation import prefill
from grkv_core.option_specs import OptionSpec, option
from grkv_core.presses import BaseMergerPress
from grkv_core.presses.from_config import build
from sweeps.config import SweepConfig
from sweeps.space import suggest_press


@dataclass
class ToyOptions:
    pull: float = option(0.5, OptionSpec("how far each kept value moves to the evicted values' mean", float, high=1.0))


@dataclass
class ToyMerger(ToyOptions, BaseMergerPress):
    """Keeps the kept keys; moves each kept value ``pull`` of the way to the mean of the evicted values."""

    def merge_selected(self, keys, values, selection, context):
        index = selection.kept_positions().unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        evicted = (~selection.mask()).unsqueeze(-1).to(values.dtype)
        evicted_mean = (values * evicted).sum(dim=2, keepdim=True) / evicted.sum(dim=2, keepdim=True).clamp(min=1)
        kept_values = values.gather(2, index)
        return keys.gather(2, index), kept_values + self.pull * (evicted_mean - kept_values)


@pytest.fixture
def toy_merger():
    MERGERS.register("toy", ToyMerger, options=ToyOptions)
    yield "toy"
    MERGERS.unregister("toy")


def help_text(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return " ".join(out.getvalue().split())


def test_a_registered_merger_is_a_command_line_choice_with_its_options_as_flags(toy_merger):
    text = help_text("eval")
    assert "toy}" in text.split("--merge {")[1].split()[0]
    assert "--pull FLOAT toy: how far each kept value moves to the evicted values' mean (default: 0.5)" in text
    args = build_parser().parse_args(["eval", "--merge", "toy", "--pull", "0.25"])
    assert (args.merge, args.pull) == ("toy", 0.25)


def test_a_registered_merger_is_validated_and_searched_by_a_sweep_config(toy_merger):
    config = SweepConfig(
        name="toy", trials=1, merge=["toy"], search_space={"pull": {"type": "float", "low": 0.1, "high": 0.9}}
    )
    press = suggest_press(optuna.create_study().ask(), config)
    assert press.merge == "toy" and 0.1 <= press.merge_options["pull"] <= 0.9
    with pytest.raises(ValueError, match=r"search_space.pull: .*1"):
        SweepConfig(
            name="toy", trials=1, merge=["toy"], search_space={"pull": {"type": "float", "low": 0.5, "high": 2}}
        )
    with pytest.raises(ValueError, match="pull must be a finite number <= 1, got 2"):
        PressConfig("snapkv", 0.5, "toy", {"pull": 2})


def test_a_registered_merger_is_built_and_merges_in_a_prefill(toy_merger):
    loaded = tiny_model()
    ids = torch.randint(3, loaded.model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    caches = {}
    for pull in (0.0, 0.5):
        press = build(PressConfig("snapkv", 0.5, "toy", {"pull": pull}))
        assert isinstance(press, ToyMerger) and press.pull == pull
        caches[pull] = prefill(loaded.model, ids, press)
    eviction = prefill(loaded.model, ids, build(PressConfig("snapkv", 0.5)))
    unmoved, moved = (caches[pull].layers[0] for pull in (0.0, 0.5))
    assert unmoved.values.shape[2] == eviction.layers[0].values.shape[2] == 24
    # pull 0 keeps the kept rows as they are: eviction alone (rows in position order, eviction's in score order).
    assert torch.allclose(unmoved.values.sum(dim=2), eviction.layers[0].values.sum(dim=2), atol=1e-5)
    assert torch.equal(unmoved.keys, moved.keys) and not torch.allclose(unmoved.values, moved.values)
