"""A cache layer that holds each head's kept rows only: what a head-adaptive press (AdaKV) really saves.

kvpress's head-adaptive presses keep a different number of tokens in each head and "compress" by masking: the cache
keeps every row and attention hides the evicted ones, so the cache's memory is the full cache's. ``PerHeadLayer``
stores, for each (batch row, KV head), only the rows that head keeps, flattened one head after the other (the
**prefix**, fixed when the press compresses), and the rows appended after it, one per head per token, in an ordinary
(B, H, t, D) tensor (the **tail**, uniform across heads). Its ``keys`` and ``values`` are ``PerHeadRows``, which answer
what the code around a transformers cache asks of a layer's tensors: ``shape`` (the length the same press would have
left without this layout), ``nbytes`` (the real size), ``[..., :n, :]`` (dropping appended rows, as kvpress's pipeline
and this project's evaluator do after each answer). Attention over them is ``grkv_core.cache.per_head_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

EAGER_REFUSAL = (
    "per_head_cache needs sdpa or flash attention (a model's attention interface), not eager: load the model with "
    "attn_implementation='sdpa'"
)


def refuse_eager(model) -> None:
    """A one-line ValueError for a model whose attention a per-head cache cannot serve: eager attention, which
    transformers calls directly, not through the attention interface (``per_head_attention``) serves."""
    if model.config.get_text_config()._attn_implementation == "eager":
        raise ValueError(EAGER_REFUSAL)


@dataclass(frozen=True)
class PerHeadRows:
    """One layer's keys (or values), each (batch row, KV head) with its own rows.

    Parameters
    ----------
    prefix : torch.Tensor
        (N, D): the rows each head kept at the compression, head ``s = b * H + h`` at
        ``prefix[offsets[s]:offsets[s + 1]]``, in position order.
    lengths : tuple of int
        (B * H,): how many prefix rows each head holds.
    tail : torch.Tensor
        (B, H, t, D): the rows appended after the compression (every head gets each token's row).
    length : int
        What ``shape[-2]`` reports: the length the layer reported when it was converted (every position under a
        masking press, the kept count under a compacting one) plus the tail's rows. Code that crops a cache back
        after an answer compares with it, as it would with the press's own layout.

    NOTE: ``lengths`` are host integers (read once, when the layer is converted): the attention splits the prefix by
    them with no device read per step.
    """

    prefix: torch.Tensor
    lengths: tuple[int, ...]
    tail: torch.Tensor
    length: int

    @property
    def shape(self) -> torch.Size:
        batch, heads, _, dim = self.tail.shape
        return torch.Size((batch, heads, self.length, dim))

    @property
    def dtype(self) -> torch.dtype:
        return self.prefix.dtype

    @property
    def device(self) -> torch.device:
        return self.prefix.device

    @property
    def nbytes(self) -> int:
        return self.prefix.nbytes + self.tail.nbytes

    def dense(self, kept: torch.Tensor) -> torch.Tensor:
        """(B, H, L, D) with the prefix rows where ``kept`` (B, H, L, the mask they were taken by) is set, zeros
        elsewhere: the masked layout's rows again (for diagnostics; the tail must be empty)."""
        if self.tail.shape[-2]:
            raise ValueError("a per-head layer with appended rows has no dense form; crop them first")
        dense = self.prefix.new_zeros(*kept.shape, self.prefix.shape[-1])
        dense[kept] = self.prefix
        return dense

    def right_aligned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's rows in one (B, H, L, D) tensor, each head's last row at L − 1 (L: the longest head's count
        plus the tail), zeros before a shorter head's first row; and (B, H, L) bool, True at a head's own rows.

        NOTE: right-aligned, so the tail (the tokens since the compression, every head's) ends every head at the same
        place: a window over the most recent rows holds for all heads.
        """
        batch, heads, tail_rows, dim = self.tail.shape
        longest = max(self.lengths)
        counts = torch.tensor(self.lengths, device=self.prefix.device).view(batch, heads, 1)
        real = torch.arange(longest, device=self.prefix.device) >= longest - counts
        rows = self.prefix.new_zeros(batch, heads, longest, dim)
        rows[real] = self.prefix  # NOTE: boolean indexing walks (b, h, l) in order, as ``per_head_rows`` took them
        every = real.new_ones(batch, heads, tail_rows)
        return torch.cat([rows, self.tail], dim=-2), torch.cat([real, every], dim=-1)

    def heads(self) -> tuple[torch.Tensor, ...]:
        """Each head's prefix rows, (L_s, D) views in head order ``s = b * H + h``."""
        return torch.split(self.prefix, self.lengths)

    def appended(self, rows: torch.Tensor) -> PerHeadRows:
        """These rows with ``rows`` (B, H, q, D) appended to every head."""
        return replace(self, tail=torch.cat([self.tail, rows], dim=-2), length=self.length + rows.shape[-2])

    def to(self, *args, **kwargs) -> PerHeadRows:
        return replace(self, prefix=self.prefix.to(*args, **kwargs), tail=self.tail.to(*args, **kwargs))

    def zero_(self) -> PerHeadRows:
        self.prefix.zero_()
        self.tail.zero_()
        return self

    def __getitem__(self, index: Any) -> PerHeadRows:
        """``[:, :, :n]`` or ``[..., :n, :]``: the rows up to ``n`` (``n`` counted as ``shape[-2]`` counts), which may
        drop appended rows only; the compressed prefix stays whole."""
        kept = _length_slice(index)
        if kept is None:
            raise ValueError(
                f"a per-head cache layer is sliced only along its length ([:, :, :n] or [..., :n, :]), got {index!r}"
            )
        stop = self.length if kept.stop is None else min(kept.stop, self.length)
        tail_rows = self.tail.shape[-2]
        if stop < self.length - tail_rows:
            raise ValueError(
                f"a per-head cache layer keeps the rows its press compressed: it can drop only the {tail_rows} rows "
                f"appended since (cropping to {stop} of {self.length})"
            )
        return replace(self, tail=self.tail[:, :, : tail_rows - (self.length - stop)], length=stop)


def stacked_rows(parts: list[PerHeadRows]) -> PerHeadRows:
    """One layer's rows whose batch rows are ``parts`` (of one length, each with its own batch rows), in order."""
    if len({part.length for part in parts}) != 1:
        raise ValueError(f"per-head rows stack only at one length, got {sorted({part.length for part in parts})}")
    return PerHeadRows(
        prefix=torch.cat([part.prefix for part in parts]),
        lengths=sum((part.lengths for part in parts), ()),
        tail=torch.cat([part.tail for part in parts]),
        length=parts[0].length,
    )


def _length_slice(index: Any) -> slice | None:
    """The slice along the length in ``[:, :, s]``, ``[:, :, s, :]`` or ``[..., s, :]`` with ``s = slice(None, n)``,
    else None."""
    whole = slice(None)
    if not isinstance(index, tuple):
        return None
    if index[:1] == (Ellipsis,) and len(index) == 3 and index[2] == whole:
        candidate = index[1]
    elif len(index) in (3, 4) and index[:2] == (whole, whole) and index[3:] in ((), (whole,)):
        candidate = index[2]
    else:
        return None
    if isinstance(candidate, slice) and candidate.start in (None, 0) and candidate.step in (None, 1):
        return candidate
    return None


def kept_rows(keys: torch.Tensor, masked: tuple | None) -> torch.Tensor:
    """(B, H, L) bool: the rows of ``keys`` (B, H, L, D) that kvpress's ``masked_key_indices`` leaves visible."""
    kept = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
    if masked is not None:
        kept[tuple(index.to(keys.device) for index in masked)] = False
    return kept


def per_head_rows(
    states: torch.Tensor, kept: torch.Tensor, lengths: tuple[int, ...], length: int | None = None
) -> PerHeadRows:
    """``states`` (B, H, L, D) reduced to the rows ``kept`` (B, H, L) marks, each head's in position order; the
    rows report ``length`` (default L) as ``shape[-2]``."""
    batch, heads, rows, dim = states.shape
    return PerHeadRows(
        prefix=states[kept],  # NOTE: boolean indexing walks (b, h, l) in order: head after head, positions ascending
        lengths=lengths,
        tail=states.new_empty(batch, heads, 0, dim),
        length=rows if length is None else length,
    )


class PerHeadLayer(DynamicLayer):
    """A cache layer whose keys and values are ``PerHeadRows``: decoding appends one row per head to the tail.

    Beam search and batch reshaping (``reorder_cache``, ``batch_repeat_interleave``, ``batch_select_indices``) are
    refused: the heads of one batch row are laid out together in the prefix.
    """

    def __init__(self, keys: PerHeadRows, values: PerHeadRows) -> None:
        from grkv_core.cache.per_head_attention import serve_per_head_rows

        serve_per_head_rows()  # NOTE: wherever such a layer exists, attention can serve it
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    @classmethod
    def from_masked(cls, keys: torch.Tensor, values: torch.Tensor, masked: tuple | None) -> PerHeadLayer:
        """The layer holding the rows of ``keys`` and ``values`` (B, H, L, D) that kvpress's ``masked_key_indices``
        (batch, head, position index tensors; None: nothing masked) leaves visible.

        NOTE: reads the per-head counts to the host once (a device synchronisation per layer and compression).
        """
        kept = kept_rows(keys, masked)
        return cls.from_kept(keys, values, kept, tuple(kept.sum(dim=-1).flatten().tolist()))

    @classmethod
    def from_kept(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        kept: torch.Tensor,
        lengths: tuple[int, ...],
        length: int | None = None,
    ) -> PerHeadLayer:
        """The layer holding the rows ``kept`` (B, H, L) marks, ``lengths`` of them per head (host integers),
        reporting ``length`` (default L) as its length."""
        return cls(per_head_rows(keys, kept, lengths, length), per_head_rows(values, kept, lengths, length))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict | None = None):
        self.keys = self.keys.appended(key_states)
        self.values = self.values.appended(value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.length

    def crop(self, max_length: int) -> None:
        stop = self.keys.length + max_length if max_length < 0 else max_length
        self.keys, self.values = self.keys[..., :stop, :], self.values[..., :stop, :]

    def _refused(self, *args, **kwargs) -> None:
        raise ValueError(
            "a per-head cache does not support beam search or batch reshaping (its heads are laid out per batch row)"
        )

    reorder_cache = batch_repeat_interleave = batch_select_indices = _refused
