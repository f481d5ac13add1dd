"""How ``gpu_check.py`` measures and reports: its report (rows per section, printed as they come, as JSON and
markdown), time marks that never synchronise (CUDA events read after the last timed round), a stopwatch for work timed
alone (synchronised before and after), ``torch.profiler``'s count of the kernels, kernel time and host
synchronisations of one prefill, and the device memory held by CUDA graphs' pools."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity

from grkv_core.evaluation.generation import prefill

# The CUDA runtime calls that make the host wait for the device (``torch.profiler``'s CPU events).
SYNCHRONISING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@dataclass
class Report:
    """What the check found: one list of rows per section, and the problems that make it fail."""

    device: str
    settings: dict
    sections: dict[str, list[dict]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def add(self, section: str, row: dict) -> None:
        self.sections.setdefault(section, []).append(row)
        print(f"[{section}] " + "  ".join(f"{key}={_text(value)}" for key, value in row.items()), flush=True)

    def markdown(self) -> str:
        lines = [f"# GRKV GPU check on {self.device}", "", "```", json.dumps(self.settings, indent=1), "```"]
        for section, rows in self.sections.items():
            columns = list(dict.fromkeys(key for row in rows for key in row))
            lines += ["", f"## {section}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_text(row.get(column, "")) for column in columns) + " |" for row in rows]
        lines += ["", "problems: " + ("; ".join(self.problems) if self.problems else "none")]
        return "\n".join(lines) + "\n"


def _text(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Marks:
    """Points in time of the work queued so far, without waiting for it: CUDA events on a GPU (read once the device
    has been synchronised after them), the wall clock on the CPU (whose work is done when its call returns)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, start, end) -> float:
        """Milliseconds from mark ``start`` to mark ``end`` (on a GPU: after ``synchronize()``)."""
        return start.elapsed_time(end) if self.cuda else 1000 * (end - start)


class Stopwatch:
    """Milliseconds of the work inside ``timed()``, alone: on a GPU the device is synchronised before (so that no
    earlier work delays the start) and after, and timed with CUDA events; the wall clock on the CPU. Never inside
    timed rounds (``Marks``): the synchronisations serialise host and device."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    @contextmanager
    def timed(self, into: list[float]):
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            torch.cuda.synchronize()
            into.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            yield
            into.append(1000 * (time.perf_counter() - started))


def profiled_prefill(model, ids: torch.Tensor, press, device: torch.device) -> tuple[int, float, int]:
    """(kernels launched, their ms on the device, host synchronisations) of one prefill under ``torch.profiler``
    (zeros on the CPU, which launches no kernels).

    NOTE: ``press`` has prefilled ``ids``' shape before, so its CUDA graphs are replayed here, not captured."""
    if device.type != "cuda":
        return 0, 0.0, 0
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        prefill(model, ids, press)
        torch.cuda.synchronize()
    events = profiler.events()
    kernels = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
    synchronisations = sum(event.name in SYNCHRONISING_CALLS for event in events)
    return len(kernels), sum(event.device_time_total for event in kernels) / 1000, synchronisations


def graph_pool_bytes() -> int:
    """Bytes of device memory in CUDA graphs' private pools: every segment outside the caching allocator's default
    pool, (0, 0) (``torch.cuda.memory_snapshot()``'s ``segment_pool_id``); whether in use or cached."""
    return sum(
        segment["total_size"] for segment in torch.cuda.memory_snapshot() if tuple(segment["segment_pool_id"]) != (0, 0)
    )
