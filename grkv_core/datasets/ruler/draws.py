"""Reproducibility: needle depths and seeded draws.

Every random choice of the generator comes from a ``random.Random`` seeded with a string naming the task,
seed, sample index and the purpose of the draw, so that a sample is a pure function of those.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable


def needle_depth(index: int) -> float:
    """Depth in [0, 1] of the needle of sample ``index``.

    0, 1, then the base-2 van der Corput sequence (1/2, 1/4, 3/4, 1/8, 5/8, ...): any first ``n``
    depths are spread evenly, and the first 2^k + 1 equal ``linspace(0, 1, 2^k + 1)``.
    """
    if index < 0:
        raise ValueError(f"sample index must be non-negative, got {index}")
    if index <= 1:
        return float(index)
    remaining, depth, scale = index - 1, 0.0, 1.0
    while remaining:
        scale /= 2
        depth += scale * (remaining & 1)
        remaining >>= 1
    return depth


def seeded_rng(task: str, seed: int, index: int, purpose: str) -> random.Random:
    # String seeds are hashed with SHA-512 by random.Random, so draws do not depend on
    # PYTHONHASHSEED, the platform or the Python version.
    return random.Random(f"grkv-ruler|{task}|{seed}|{index}|{purpose}")


class DistinctDraws:
    """Seeded stream of distinct strings; item ``i`` never depends on how many are requested."""

    def __init__(self, rng: random.Random, draw: Callable[[random.Random], str]) -> None:
        self._rng = rng
        self._draw = draw
        self._items: list[str] = []
        self._seen: set[str] = set()

    def first(self, count: int) -> list[str]:
        """The first ``count`` items of the stream."""
        rejections = 0
        while len(self._items) < count:
            item = self._draw(self._rng)
            if item in self._seen:
                rejections += 1
                if rejections > 10_000:
                    raise RuntimeError(f"could not draw {count} distinct items; the pool is too small")
                continue
            self._seen.add(item)
            self._items.append(item)
        return self._items[:count]


def draw_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def draw_number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def draw_variable_name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=5))


def draw_coded_word(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=6))
