"""RULER's 13 tasks: names, defaults, per-family constants and the specification of each task."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from grkv_core.datasets.schema import validate_task_selection

RULER_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
"""The 13 standard RULER tasks."""

RULER_DEFAULT_CONTEXT_LENGTH = 4096
RULER_DEFAULT_SAMPLES_PER_TASK = 500
"""RULER's standard number of samples per task and length (also the size of the hub copy)."""
NOISE_SENTENCES: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
FWE_FILLER = "...."
FWE_ZIPF_NORMALISER = math.pi**2 / 6
"""Sum over ranks r >= 1 of r^-2: RULER's fwe uses Zipf exponent 2."""
CWE_NUM_COMMON_WORDS = 10
CWE_FREQUENCY_SCHEDULE: tuple[tuple[int, int], ...] = ((30, 3), (20, 3), (10, 3), (6, 2), (3, 1))
"""(common, uncommon) word frequencies, tried in order: RULER's (30, 3) first, lower ones for
contexts where the common words alone would take more than half of the budget."""
VT_NUM_HOPS = 4


@dataclass(frozen=True)
class NeedleSpec:
    """Shape of a needle-in-a-haystack task.

    Parameters
    ----------
    haystack : {"noise", "essay", "needles"}
        Filler: repeated noise sentences, Paul Graham essays, or distractor needles.
    key_kind : {"word", "uuid"}
        Needle keys: "adjective-noun" words or UUIDs.
    value_kind : {"number", "uuid"}
        Needle values: 7-digit numbers or UUIDs.
    num_keys : int
        Distinct keys hidden (the first ``num_queries`` are asked about).
    num_values : int
        Values hidden per key; all of a queried key's values are expected.
    num_queries : int
        Keys asked about in the single question.
    """

    haystack: Literal["noise", "essay", "needles"]
    key_kind: Literal["word", "uuid"]
    value_kind: Literal["number", "uuid"]
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


@dataclass(frozen=True)
class RulerTaskSpec:
    """One RULER task: its family, generation budget, metric and family-specific shape."""

    family: Literal["niah", "vt", "cwe", "fwe", "qa"]
    max_new_tokens: int
    metric: Literal["string_match_all", "string_match_part"]
    needle: NeedleSpec | None = None
    qa_source: Literal["squad", "hotpotqa"] | None = None


def _niah(needle: NeedleSpec) -> RulerTaskSpec:
    return RulerTaskSpec("niah", 128, "string_match_all", needle=needle)


RULER_TASK_SPECS: dict[str, RulerTaskSpec] = {
    "niah_single_1": _niah(NeedleSpec("noise", "word", "number")),
    "niah_single_2": _niah(NeedleSpec("essay", "word", "number")),
    "niah_single_3": _niah(NeedleSpec("essay", "word", "uuid")),
    "niah_multikey_1": _niah(NeedleSpec("essay", "word", "number", num_keys=4)),
    "niah_multikey_2": _niah(NeedleSpec("needles", "word", "number")),
    "niah_multikey_3": _niah(NeedleSpec("needles", "uuid", "uuid")),
    "niah_multivalue": _niah(NeedleSpec("essay", "word", "number", num_values=4)),
    "niah_multiquery": _niah(NeedleSpec("essay", "word", "number", num_keys=4, num_queries=4)),
    "vt": RulerTaskSpec("vt", 30, "string_match_all"),
    "cwe": RulerTaskSpec("cwe", 120, "string_match_all"),
    "fwe": RulerTaskSpec("fwe", 50, "string_match_all"),
    "qa_1": RulerTaskSpec("qa", 32, "string_match_part", qa_source="squad"),
    "qa_2": RulerTaskSpec("qa", 32, "string_match_part", qa_source="hotpotqa"),
}


def validate_ruler_tasks(tasks: Sequence[str] | str | None) -> tuple[str, ...]:
    """Normalise a RULER task selection; see :func:`validate_task_selection`."""
    return validate_task_selection(tasks, RULER_TASKS, "RULER")
