"""Prompt assembly and length fitting: token counting, inserting needles into a haystack, and the search for the
largest haystack that fits a token budget."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

TokenCounter = Callable[[str], int]


def estimate_tokens(text: str) -> int:
    """Token estimate used without a tokenizer: 1.3 tokens per whitespace-separated word."""
    return math.ceil(len(text.split()) * 1.3)


def make_token_counter(tokenizer: Any | None) -> TokenCounter:
    """Token counter from a tokenizer (anything with ``encode(text)`` returning a sequence).

    ``None`` gives :func:`estimate_tokens`. A Hugging Face tokenizer counts its special tokens too
    (a BOS token, typically), which keeps generated prompts on the safe side of the budget.
    """
    if tokenizer is None:
        return estimate_tokens
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no encode(text) method")
    return lambda text: len(encode(text))


@dataclass(frozen=True)
class Prompt:
    """A generated prompt, before it becomes an EvalSample."""

    context: str
    question: str
    answer_prefix: str
    references: tuple[str, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def full_text(self) -> str:
        return self.context + self.question + self.answer_prefix


def join_with_insertions(
    units: Sequence[str], insertions: Sequence[tuple[int, str]], separator: str
) -> tuple[str, list[int]]:
    """Join ``units`` with ``separator``, inserting each text before the unit at its position.

    Returns the text and the character offset of each inserted text (in the order given). Texts
    sharing a position keep their given order.
    """
    order = sorted(range(len(insertions)), key=lambda k: insertions[k][0])
    pieces: list[str] = []
    offsets = [0] * len(insertions)
    length = 0
    cursor = 0

    def push(piece: str) -> int:
        nonlocal length
        if pieces:
            length += len(separator)
        offset = length
        pieces.append(piece)
        length += len(piece)
        return offset

    for k in order:
        position = min(max(insertions[k][0], 0), len(units))
        if position > cursor:
            push(separator.join(units[cursor:position]))
            cursor = position
        offsets[k] = push(insertions[k][1])
    if cursor < len(units):
        push(separator.join(units[cursor:]))
    return separator.join(pieces), offsets


def fit_to_budget(
    build: Callable[[int], Prompt],
    count_tokens: TokenCounter,
    budget: int,
    max_units: int | None = None,
) -> tuple[int, int]:
    """Largest unit count ``n`` (<= ``max_units``) whose prompt has at most ``budget`` tokens.

    The prompt length is close to linear in ``n``, so the search extrapolates from the measured
    tokens per unit, then alternates interpolation and bisection inside the bracket: a handful of
    tokenizations instead of a plain bisection's ~2 log2(n).

    Returns
    -------
    (n, tokens) : tuple[int, int]

    Raises
    ------
    ValueError
        If even the prompt without any haystack exceeds the budget.
    """
    measured: dict[int, int] = {}

    def tokens_for(n: int) -> int:
        if n not in measured:
            measured[n] = count_tokens(build(n).full_text)
        return measured[n]

    base = tokens_for(0)
    if base > budget:
        raise ValueError(f"the prompt needs {base} tokens without any haystack, over the budget of {budget}")
    lo, lo_tokens = 0, base
    hi = hi_tokens = None
    probe = 16 if max_units is None else min(16, max_units)
    while hi is None:
        if probe <= lo:  # max_units reached and it fits
            return lo, lo_tokens
        probe_tokens = tokens_for(probe)
        if probe_tokens > budget:
            hi, hi_tokens = probe, probe_tokens
            break
        lo, lo_tokens = probe, probe_tokens
        tokens_per_unit = max((probe_tokens - base) / probe, 1e-9)
        # Aim 5% past the extrapolated fit, so the next probe usually closes the bracket.
        probe = max(lo + 1, int((lo + (budget - probe_tokens) / tokens_per_unit) * 1.05) + 1)
        if max_units is not None:
            probe = min(probe, max_units)
    interpolate = True
    while hi - lo > 1:
        if interpolate:
            middle = lo + int((budget - lo_tokens) * (hi - lo) / max(hi_tokens - lo_tokens, 1))
        else:
            middle = (lo + hi) // 2
        middle = min(max(middle, lo + 1), hi - 1)
        interpolate = not interpolate
        middle_tokens = tokens_for(middle)
        if middle_tokens <= budget:
            lo, lo_tokens = middle, middle_tokens
        else:
            hi, hi_tokens = middle, middle_tokens
    return lo, lo_tokens
