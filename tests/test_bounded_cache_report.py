"""benchmarks/bounded_cache.py's arithmetic: the exchange rate and the cells."""

import math

import pytest

from benchmarks.bounded_cache import BASE_PRESSES, MERGERS, TARGET_SIZES, cells, exchange_rate


@pytest.mark.parametrize(
    "nll, expected",
    [(2.5, 2**9.5), (2.6, 512), (2.8, 2**8.5), (3.0, "≤ 256"), (3.1, "≤ 256"), (2.3, "> 1024")],
)
def test_the_exchange_rate_interpolates_eviction_in_log2_size(nll, expected):
    eviction = {256: 3.0, 512: 2.6, 1024: 2.4}
    found = exchange_rate(nll, eviction)
    if isinstance(expected, str):
        assert found == expected
    else:
        assert math.isclose(float(found), expected, rel_tol=2e-3)


def test_the_table_has_every_cell_once_and_grkv_takes_the_tuned_options():
    rows = cells({"lambda_k": 0.5})
    assert len(rows) == 1 + len(TARGET_SIZES) * len(BASE_PRESSES) * len(MERGERS)
    assert len({name for name, _, _ in rows}) == len(rows)
    assert all(press.merge_options == ({"lambda_k": 0.5} if press.merge == "grkv" else {}) for _, press, _ in rows)
