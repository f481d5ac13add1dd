"""GRKV reads the device on the host once per prefill (its warnings' counts), under every option a sweep searches: on a
GPU each host read is a synchronisation, where the host waits for every kernel queued before it. Counted by
``benchmarks/prefill_ops.py``'s ``CountedOperations``, the counter behind the figures in the results."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from conftest import tiny_model

import grkv_core.solver.key_step as key_step_module
import grkv_core.solver.merge as merge_module
from benchmarks.prefill_ops import CountedOperations
from grkv_core.evaluation.generation import prefill
from grkv_core.presses.from_config import build_press

# One value of each searchable option that takes a path of its own through the press and the solver.
SEARCHED = [
    {},
    {"query_policy": "stratified", "window_size": 16},
    {"query_policy": "mixture", "window_size": 16},
    {"query_policy": "expected", "window_size": 16},
    {"max_rel_update_k": 0.025, "max_rel_update_v": 0.1},
    {"accept": "objective"},
    {"accept": "validation"},
    {"ridge_scale": "relative"},
    {"head_weighting": "o_proj"},
    {"components": "k"},
    {"components": "v"},
    {"steps": 3},
    {"safeguard": False, "cg_max_iter": 20},
    {"layers_per_solve": 1},
    {"merged_layers": "late", "fix_window": False, "beta": 0.0},
    {"target_from_forward": False},
]


def host_reads(model, ids, press) -> int:
    prefill(model, ids, press)  # NOTE: the first prefill builds what later ones reuse
    with CountedOperations() as counted:
        prefill(model, ids, press)
    return counted.host_reads.total()


@pytest.mark.parametrize(
    "options", SEARCHED, ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()) or "defaults"
)
@pytest.mark.parametrize("base", ["snapkv", "pyramidkv"])
def test_grkv_adds_one_host_read_per_prefill(options, base, monkeypatch):
    # NOTE: on the CPU, where a host read costs nothing, the solver's loops read a flag to stop early
    # (``reads_are_free``); this counts the reads a GPU pays, so it takes the GPU's path.
    for module in (merge_module, key_step_module):
        monkeypatch.setattr(module, "reads_are_free", lambda tensor: False)
    model = tiny_model("tiny-llama").model
    ids = torch.randint(0, 256, (1, 256), generator=torch.Generator().manual_seed(0))
    evicted = host_reads(model, ids, build_press(base, 0.75))
    merged = host_reads(model, ids, build_press(base, 0.75, merge="grkv", **options))
    assert merged - evicted == 1
