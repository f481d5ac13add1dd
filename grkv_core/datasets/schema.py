"""The one row schema shared by every benchmark (RULER, LongBench, fixtures)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class EvalSample:
    """One evaluation item, in the kvpress protocol's terms.

    The context is compressed alone during prefill; each question (with ``answer_prefix``) is then
    appended to the compressed cache and answered by greedy decoding.

    Parameters
    ----------
    sample_id : str
        Stable identifier, unique within a dataset (used to resume interrupted runs).
    task : str
        Task name, e.g. ``"niah_single_1"`` or ``"hotpotqa"``.
    context : str
        The long text that is compressed.
    questions : tuple[str, ...]
        One or more questions asked about the same context; they share the compressed cache.
    answer_prefix : str
        Text appended after each question, before generation starts.
    references : tuple[tuple[str, ...], ...]
        For each question, the acceptable answers (RULER: the needles; LongBench: gold answers).
    max_new_tokens : int
        Generation budget per question.
    metric : str
        Name of the scorer in ``grkv_core.datasets.scoring`` used for this task.
    extra : dict
        Task-specific fields needed by a scorer (e.g. LongBench ``all_classes``).
    """

    sample_id: str
    task: str
    context: str
    questions: tuple[str, ...]
    answer_prefix: str
    references: tuple[tuple[str, ...], ...]
    max_new_tokens: int
    metric: str
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not self.questions:
            raise ValueError(f"sample {self.sample_id!r}: at least one question is required")
        if len(self.references) != len(self.questions):
            raise ValueError(
                f"sample {self.sample_id!r}: {len(self.references)} reference lists for {len(self.questions)} questions"
            )
        if self.max_new_tokens <= 0:
            raise ValueError(f"sample {self.sample_id!r}: max_new_tokens must be positive")

    def to_dict(self) -> dict:
        return asdict(self)


def validate_task_selection(
    tasks: Sequence[str] | str | None, valid: tuple[str, ...], benchmark: str
) -> tuple[str, ...]:
    """Normalise a task selection (``None`` = all of ``valid``, a single name or a sequence of names).

    Raises
    ------
    ValueError
        If the selection is empty or a name is not in ``valid`` (the message lists the valid names).
    """
    if tasks is None:
        return valid
    selected = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    unknown = [task for task in selected if task not in valid]
    if unknown or not selected:
        raise ValueError(f"unknown {benchmark} task(s) {unknown or selected!r}; valid tasks: {', '.join(valid)}")
    return selected
