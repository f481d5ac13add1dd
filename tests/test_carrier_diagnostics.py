"""Carrier concentration (paper App. B) on hand-built assignments, and the merge-map / cross-window plots."""

import math

import pytest
import torch
from kvpress import SnapKVPress
from PIL import Image

from grkv_core.diagnostics.carriers import (
    CarrierConcentration,
    carrier_concentration,
    carrier_concentration_per_unit,
    macro_average,
    span_boundaries,
)
from grkv_core.diagnostics.plots import plot_cross_window_consistency, plot_merge_map
from grkv_core.diagnostics.windows import cross_window_similarity, window_output_summaries
from grkv_core.presses import D2OPress, MergeInputs
from grkv_core.solver.losses import recover_kept_positions

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def long(values):
    return torch.tensor(values, dtype=torch.long)


def test_equal_loads_give_zero_gini_and_every_carrier_effective():
    result = carrier_concentration(long([0, 1, 2, 3, 0, 1, 2, 3]), long([0, 2, 4, 6]))
    assert result.gini == pytest.approx(0.0, abs=1e-12)
    assert result.effective_fraction == pytest.approx(1.0)  # b_eff = c
    assert result.active_fraction == 1.0
    assert result.max_load_ratio == pytest.approx(1.0)
    # Four one-token spans: every carrier is a boundary, so there is no interior to compare with.
    assert result.boundary_carrier_fraction == 1.0 and result.enrichment == pytest.approx(1.0)
    assert math.isnan(result.boundary_interior_load)


def test_all_assignments_on_one_carrier():
    result = carrier_concentration(long([2, 2, 2, 2, 2]), long([0, 1, 2, 3]))
    assert result.max_load_ratio == pytest.approx(4.0)  # max / mean = 5 / (5/4) = c
    assert result.effective_fraction == pytest.approx(1 / 4)  # b_eff = 1
    assert result.active_fraction == pytest.approx(1 / 4)
    assert result.gini == pytest.approx(3 / 4)  # (c - 1) / c
    # One span 0..3: boundaries 0 and 3, the loaded carrier 2 is interior.
    assert result.boundary_assignment_ratio == 0.0 and result.boundary_interior_load == 0.0


def test_worked_boundary_example():
    # n = 15. Kept spans [0..3], [6..8], [12] -> boundary carriers at positions 0, 3, 6, 8, 12 (kept
    # indices 0, 3, 4, 6, 7), interior at 1, 2, 7 (indices 1, 2, 5).
    kept = long([0, 1, 2, 3, 6, 7, 8, 12])
    assert span_boundaries(kept).tolist() == [True, False, False, True, True, False, True, True]
    # Evicted 4, 5, 9, 10, 11, 13, 14 -> kept indices 3, 4, 6, 6, 7, 7, 1 and a dropped one (-1).
    # Loads by kept index: [0, 1, 0, 1, 1, 0, 2, 2], total 7.
    result = carrier_concentration(long([3, 4, 6, 6, 7, 7, 1, -1]), kept)
    assert result.n_assigned == 7 and result.n_kept == 8
    assert result.active_fraction == pytest.approx(5 / 8)
    assert result.effective_fraction == pytest.approx(49 / 11 / 8)  # 7² / (1+1+1+4+4), over c
    assert result.max_load_ratio == pytest.approx(2 / (7 / 8))
    # Σ_ij |a_i - a_j| = 2·(9·1 + 6·2 + 6·1) = 54, over 2·c·Σa = 112.
    assert result.gini == pytest.approx(54 / 112)
    assert result.boundary_carrier_fraction == pytest.approx(5 / 8)
    assert result.boundary_assignment_ratio == pytest.approx(6 / 7)
    assert result.enrichment == pytest.approx((6 / 7) / (5 / 8))
    assert result.boundary_interior_load == pytest.approx((6 / 5) / (1 / 3))


def test_interior_carriers_with_no_load_make_the_load_ratio_infinite():
    assert carrier_concentration(long([0, 2]), long([0, 1, 2])).boundary_interior_load == math.inf


def test_per_unit_and_macro_average():
    assignment = long([[[0, 0, 1, 1], [2, 2, 2, 2]], [[-1, -1, -1, -1], [0, 1, 2, 2]]])
    kept = long([[[0, 1, 2], [0, 1, 2]], [[0, 1, 2], [0, 5, 9]]])
    units = carrier_concentration_per_unit(assignment, kept)
    assert len(units) == 4 and units[2] is None  # nothing assigned in unit (1, 0)
    average = macro_average(units)
    assert average.n_units == 3
    assert average.gini == pytest.approx(sum(unit.gini for unit in units if unit) / 3)
    # Unit (1, 1) has only boundary carriers: its load ratio is undefined and left out of the mean.
    assert math.isnan(units[3].boundary_interior_load)
    assert average.boundary_interior_load == pytest.approx(
        (units[0].boundary_interior_load + units[1].boundary_interior_load) / 2
    )
    assert isinstance(average, CarrierConcentration)


@pytest.mark.parametrize(
    "assignment,kept,message",
    [
        (long([0, 3]), long([0, 1, 2]), "assignment entries"),
        (long([0, -2]), long([0, 1, 2]), "assignment entries"),
        (torch.tensor([0.0, 1.0]), long([0, 1]), "integer"),
        (long([0, 1]), long([0, 2, 1]), "strictly increasing"),
        (long([0]), long([]), "non-empty"),
        (long([-1, -1]), long([0, 1]), "undefined"),
    ],
)
def test_bad_input_raises_value_error(assignment, kept, message):
    with pytest.raises(ValueError, match=message):
        carrier_concentration(assignment, kept)


def test_bad_batches_raise_value_error():
    with pytest.raises(ValueError, match="at least one unit"):
        macro_average([None])
    with pytest.raises(ValueError, match="leading"):
        carrier_concentration_per_unit(long([[0, 1]]), long([[[0, 1]]]))


def span_retention_cache(seed=0):
    """A head whose keys drift smoothly along the sequence and whose kept set is three spans."""
    generator = torch.Generator().manual_seed(seed)
    keys = (torch.randn(160, 8, generator=generator) * 0.3).cumsum(dim=0) + torch.randn(8, generator=generator)
    kept_mask = torch.zeros(160, dtype=torch.bool)
    for start, stop in [(0, 8), (50, 70), (120, 160)]:
        kept_mask[start:stop] = True
    return keys, kept_mask


def test_key_cosine_matching_concentrates_on_span_boundaries():
    # The paper's claim in miniature: locally similar keys + span retention -> boundary carriers overloaded.
    keys, kept_mask = span_retention_cache()
    inputs = MergeInputs.from_kept_mask(keys[None, None], keys[None, None], kept_mask[None, None])
    assignment = D2OPress(press=SnapKVPress(), threshold=-1.0).assign_carriers(inputs)
    result = carrier_concentration(assignment[0, 0], inputs.kept[0, 0])
    assert result.boundary_carrier_fraction == pytest.approx(6 / 68)
    assert result.enrichment > 2 and result.boundary_interior_load > 3


def assert_png(path, min_bytes=10_000):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > min_bytes
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        width, height = image.size
    assert width > 300 and height > 300


def test_merge_map_png(tmp_path):
    keys, kept_mask = span_retention_cache()
    inputs = MergeInputs.from_kept_mask(keys[None, None], keys[None, None], kept_mask[None, None])
    assignment = D2OPress(press=SnapKVPress(), threshold=-1.0).assign_carriers(inputs)[0, 0]
    path = plot_merge_map(
        tmp_path / "maps" / "merge_map.png",
        keys,
        inputs.kept[0, 0],
        assignment,
        title="D2O-style key matching over three kept spans",
    )
    assert path == tmp_path / "maps" / "merge_map.png"
    assert_png(path)
    with pytest.raises(ValueError, match="one entry per evicted token"):
        plot_merge_map(tmp_path / "bad.png", keys, inputs.kept[0, 0], assignment[:-1])


def test_window_summaries_by_hand():
    # Zero queries attend uniformly to the causal prefix: o_t = mean(v_0..v_t).
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
    summaries = window_output_summaries(torch.zeros(4, 2), torch.randn(4, 2), values, window=2)
    # o = [1,0], [.5,.5], [2/3,2/3], [1,.5] -> windows [.75,.25] and [5/6, 7/12].
    torch.testing.assert_close(summaries, torch.tensor([[0.75, 0.25], [5 / 6, 7 / 12]]))
    cosine = (0.75 * 5 / 6 + 0.25 * 7 / 12) / (math.hypot(0.75, 0.25) * math.hypot(5 / 6, 7 / 12))
    torch.testing.assert_close(cross_window_similarity(summaries), torch.tensor([[1.0, cosine], [cosine, 1.0]]))
    # A trailing partial window is left out.
    assert window_output_summaries(torch.zeros(5, 2), torch.randn(5, 2), torch.randn(5, 2), window=2).shape == (2, 2)
    with pytest.raises(ValueError, match="window"):
        window_output_summaries(torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(4, 2), window=5)


def test_cross_window_consistency_png(tmp_path):
    generator = torch.Generator().manual_seed(1)
    queries, keys = torch.randn(2, 320, 16, generator=generator), torch.randn(2, 320, 16, generator=generator)
    values = torch.randn(2, 320, 16, generator=generator) + 1.0
    similarity = cross_window_similarity(window_output_summaries(queries, keys, values, window=32))
    assert similarity.shape == (2, 10, 10)
    path = plot_cross_window_consistency(tmp_path / "consistency.png", similarity[0], prompt_windows=9)
    assert_png(path)
    with pytest.raises(ValueError, match="square"):
        plot_cross_window_consistency(tmp_path / "bad.png", similarity[0, :3])


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kept_positions_are_recovered_from_an_evicted_cache_at_real_cache_shapes(dtype, batch):
    # SmolLM2's shapes at 2K with 10% kept, contiguous or not: a row's fingerprint must not depend on the
    # shape or layout of the call computing it (a floating-point dot product's rounding does).
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(batch, 3, 1909, 64, generator=generator).to(dtype)
    kept = torch.stack(
        [torch.stack([torch.randperm(1909, generator=generator)[:190] for _ in range(3)]) for _ in range(batch)]
    )
    evicted = full.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, 64))
    assert torch.equal(recover_kept_positions(evicted, full), kept)
    head_major = evicted.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(recover_kept_positions(head_major, full), kept)
    merged = evicted.clone()
    merged[-1, 2, 7] += 1.0
    with pytest.raises(ValueError, match="not verbatim rows"):
        recover_kept_positions(merged, full)
