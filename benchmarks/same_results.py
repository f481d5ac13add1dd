"""Whether two result folders of ``grkv eval``/``grkv compare`` (``--output-dir``) hold the same results: per method and
sample, identical predictions and every numeric field (timings and memory peaks aside) within a tolerance: ``a`` and
``b`` agree when ``|a - b| <= atol + rtol * |a|`` (NumPy's ``allclose``; ``--atol`` is 0 unless given).

    python -m benchmarks.same_results /tmp/before /tmp/after    # exit 1 if they differ

For a change that must leave results unchanged: run the same command before and after it, then this. Either folder
may hold its result files compressed (``x.json.gz``, as committed). For two layouts of one cache (``grkv compare
--per-head-cache`` against the masked layout), ``--after-suffix=-per-head`` pairs ``x.json`` with ``x-per-head.json``
and ``--ignore kv_bytes`` leaves out what the layout changes by design. The largest relative difference is printed
with its field.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from grkv_core.files import json_files, read_json

# Fields that measure the run, not the result.
TIMINGS = ("ttft_s", "prefill_s", "decode_ms_per_token", "wall_s", "peak_memory_bytes", "compress_s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rtol", type=float, default=1e-6)
    parser.add_argument("--atol", type=float, default=0.0, help="an absolute tolerance beside --rtol (default 0)")
    parser.add_argument("--after-suffix", default="", help="the after file of x.json is x<SUFFIX>.json, if it exists")
    parser.add_argument("--ignore", action="append", default=[], metavar="FIELD", help="a numeric field not compared")
    args = parser.parse_args()
    same = True
    ignored = (*TIMINGS, *args.ignore)
    for path in json_files(args.before):
        before = read_json(path)["samples"]
        stem, _, extension = path.name.partition(".")
        renamed = args.after / f"{stem}{args.after_suffix}.{extension}"
        after = read_json(renamed if renamed.exists() else args.after / path.name)["samples"]
        predictions = len(before) == len(after) and all(
            x["predictions"] == y["predictions"] for x, y in zip(before, after)
        )
        worst, worst_field, fields, close = 0.0, "", 0, True
        for x, y in zip(before, after):
            for key, value in x.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ignored:
                    fields += 1
                    difference = abs(value - y[key])
                    close &= difference <= args.atol + args.rtol * abs(value)
                    relative = difference / max(abs(value), 1e-30)
                    if relative > worst:
                        worst, worst_field = relative, key
        ok = predictions and close
        same &= ok
        largest = f"{worst:.3g}" + (f" ({worst_field})" if worst_field else "")
        print(
            f"{path.stem}: {len(before)} samples, predictions {'identical' if predictions else 'DIFFER'}, "
            f"{fields} numeric fields, largest relative difference {largest}, {'ok' if ok else 'DIFFERS'}"
        )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
