"""benchmarks/bounded_cache.py's arithmetic: the exchange rate and the cells."""

import json
import math

import pytest

from benchmarks.bounded_cache import BASE_PRESSES, MERGERS, TARGET_SIZES, cells, exchange_rate, report


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


def write_cell(folder, name, nll_of_text, seconds=60.0):
    for domain in ("essays", "code"):
        path = folder / "smollm2-135m" / domain / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [
            {"item_id": text, "nll": nll, "seconds": seconds}
            for (where, text), nll in nll_of_text.items()
            if where == domain
        ]
        path.write_text("\n".join(json.dumps(row) for row in [{"config": {}}, *rows]) + "\n")


def test_the_report_gives_each_merger_the_rules_verdict_with_its_mean_delta_and_median_exchange_ratio(tmp_path):
    """40 texts per cell; eviction at 3.0 / 2.6 / 2.4 nats (256 / 512 / 1024) plus a text's own offset; GRKV 0.1 below
    eviction in every cell, CaM 0.5 above, D2O ±0.01 around it: earns its memory, harms, does no harm."""
    texts = [(domain, f"text{i}") for domain in ("essays", "code") for i in range(20)]
    offset = {text: 0.05 * (i % 7) for i, text in enumerate(texts)}
    eviction = {256: 3.0, 512: 2.6, 1024: 2.4}
    change = {"none": lambda i: 0.0, "grkv": lambda i: -0.1, "cam": lambda i: 0.5, "d2o": lambda i: (-1) ** i * 0.01}
    write_cell(tmp_path, "full", {text: 2.3 + offset[text] for text in texts})
    for press in BASE_PRESSES:
        for size in TARGET_SIZES:
            for merge in MERGERS:
                nll = {text: eviction[size] + offset[text] + change[merge](i) for i, text in enumerate(texts)}
                write_cell(tmp_path, f"{press}-{size}-{merge}", nll, 120.0 if merge == "grkv" else 60.0)
    text = report(tmp_path)
    assert "(partial)" not in text
    verdicts = {line.split(":")[0][2:]: line for line in text.splitlines() if line.startswith("- ")}
    # GRKV at 256 matches eviction at 2^(8 + 0.1/0.4) = 304 rows, at 512 at 2^(9 + 0.1/0.2) = 724; at 1024 it is
    # below eviction's smallest NLL (outside the measured sizes): the median of 304/256 and 724/512, three each.
    assert verdicts["grkv"].startswith("- grkv: earns its memory (better in 9, worse in 0 of 9 cells")
    assert "mean Δ -0.1000 nats" in verdicts["grkv"]
    assert f"median exchange ratio {(304 / 256 + 724 / 512) / 2:.2f} over 6 cells" in verdicts["grkv"]
    assert verdicts["cam"].startswith("- cam: harms (better in 0, worse in 9 of 9 cells")
    assert "mean Δ +0.5000 nats" in verdicts["cam"]
    assert verdicts["d2o"].startswith("- d2o: does no harm (better in 0, worse in 0 of 9 cells")
    assert (tmp_path / "report.md").read_text() == text + "\n"
    # Each text: the full cache and 27 rows at 60 s, 9 GRKV rows at 120 s: 2,760 s.
    assert (
        "a text through all 37 rows took a median 46 minutes (46 to 46, 40 texts); a GRKV row a median 2.00× its "
        "eviction row's time (360 pairs)."
    ) in text

    path = tmp_path / "smollm2-135m" / "code" / "knorm-512-grkv.jsonl"
    path.write_text("\n".join(path.read_text().splitlines()[:-1]) + "\n")
    assert "| knorm | 512 | grkv | 39 (partial) |" in report(tmp_path)
