"""MergingDecodingPress: a cache kept bounded while the model decodes, the evicted rows merged into the kept ones."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from kvpress import AdaKVPress, BasePress, DecodingPress, ScorerPress, StreamingLLMPress
from torch import nn

from grkv_core import options
from grkv_core.cache.per_head import PerHeadLayer, refuse_eager
from grkv_core.option_specs import options_docstring
from grkv_core.presses.merging import BaseMergerPress
from grkv_core.presses.padding import padding_refused
from grkv_core.presses.per_head_decoding import compress_per_head_layer, per_head_refusal
from grkv_core.presses.selection import (
    MASKING_PRESSES,
    SUPPORTED_BASE_PRESSES,
    forced_score_ranges,
    select_tokens,
    unsupported_base_press_reason,
)
from grkv_core.presses.sliding_layers import unhook_sliding_layers
from grkv_core.solver.problem import gather_rows
from grkv_core.stream_options import DecodingOptions


@dataclass
class _LayerStream:
    """One layer's decode-time state: the recent tokens' hidden states and RoPE tables, the tokens since its last
    compression, and the stream position of each cached row.

    NOTE: the rows added since the last compression are the stream positions ``positions_through`` … ``seen`` − 1 in
    order, so only the rows before them are stored (``all_positions`` adds the rest): nothing is concatenated per
    step. The buffer is trimmed to its size only once it holds twice that, for the same reason.
    """

    seen: int
    positions: torch.Tensor  # (B, H_kv, rows) long, the rows cached up to ``positions_through``; -1 where unknown
    positions_through: int
    hidden_states: list[torch.Tensor] = field(default_factory=list)
    cos: list[torch.Tensor] = field(default_factory=list)
    sin: list[torch.Tensor] = field(default_factory=list)
    buffered: int = 0
    since_compression: int = 0
    per_head: bool = False  # the layer holds each head's own rows: ``positions`` no longer describes them

    def buffer(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, size: int) -> None:
        """Add a forward's tokens, keeping at least the last ``size`` of them."""
        batch = hidden_states.shape[0]
        self.hidden_states.append(hidden_states.detach())
        self.cos.append(cos.expand(batch, -1, -1))
        self.sin.append(sin.expand(batch, -1, -1))
        self.buffered += hidden_states.shape[1]
        if self.buffered > 2 * size:
            for parts in (self.hidden_states, self.cos, self.sin):
                parts[:] = [torch.cat(parts, dim=1)[:, -size:]]
            self.buffered = size

    def recent(self, size: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(B, r, hidden) the last r <= ``size`` buffered tokens' hidden states and their (cos, sin), (B, r, d)."""
        return tuple(torch.cat(parts, dim=1)[:, -size:] for parts in (self.hidden_states, self.cos, self.sin))

    def clear_buffer(self) -> None:
        self.hidden_states, self.cos, self.sin, self.buffered = [], [], [], 0

    def all_positions(self) -> torch.Tensor:
        """(B, H_kv, rows) the stream position of every cached row."""
        added = torch.arange(self.positions_through, self.seen, device=self.positions.device)
        return torch.cat([self.positions, added.expand(*self.positions.shape[:2], -1)], dim=-1)


@dataclass
class MergingDecodingPress(DecodingOptions, DecodingPress):
    """Keep every layer's cache bounded while the model decodes: every ``compression_interval`` tokens the cache is
    brought back to ``target_size`` rows (or to a fraction of the tokens seen, ``target_compression_ratio``), the base
    press choosing the rows and, when it is a merger, the evicted rows merged into the kept ones.

    kvpress's ``DecodingPress`` accepts an eviction press only; this one accepts any merger of this library around any
    eviction press with a uniform budget (GRKV, CaM, D2O, AsymKV, KVMerger), or the eviction press alone (the baseline,
    through the same steps). On a per-head cache (``PerHeadCachePress``), and with ``AdaKVPress`` as the base press,
    which makes one, each head is bounded on its own rows (``grkv_core.presses.per_head_decoding``). The base press
    scores with the hidden states of the most recent ``hidden_states_buffer_size`` tokens, and GRKV's surrogate queries
    are theirs (its query policy applied to those tokens), at their own positions; its target is their attention over
    the cache just before the compression.

    Differences from kvpress's ``DecodingPress``, each on purpose:

    * the interval counts tokens, not forward calls: a forward of 128 tokens is 128 steps, so a teacher-forced stream
      fed in chunks of ``compression_interval`` holds at each chunk's end exactly the cache that decoding token by
      token holds (``grkv_core.evaluation.streaming``);
    * the buffered queries are rotated to their own positions (kvpress's rotates them all to the current token's);
    * a prompt longer than the target is compressed at its end too, so the cache never holds more than
      ``target_size + compression_interval`` rows (inside ``PrefillDecodingPress`` the prefilling press has the
      prefill instead);
    * the kept rows stay in stream order (kvpress's eviction leaves them in score order), so a press that keeps rows
      by their place (StreamingLLM's sinks and recent window, GRKV's fixed sinks and window) finds them there.

    NOTE: a compressed cache is shorter than the stream: whatever feeds the model next passes the stream's
    ``position_ids`` (``model.generate`` and kvpress's pipeline do). The state (buffers, counts, the rows' stream
    positions) exists only within one context of the press (``with press(model):``, or the enclosing
    ``PrefillDecodingPress``'s), so the same press used twice gives the same result twice.

    Parameters
    ----------
    base_press : BasePress
        A merger (``BaseMergerPress``) around an eviction press, or an eviction press (one of
        ``grkv_core.presses.selection.SUPPORTED_BASE_PRESSES`` with the same budget in every head).
    """

    base_press: BasePress = None
    # NOTE: read by the mergers' check of the press that calls them (``merging._wrapper_misuse``).
    merges_while_decoding = True

    def __post_init__(self) -> None:
        # NOTE: kvpress's __post_init__ asserts a ScorerPress; everything it sets up is replaced here.
        options.check_options(self)
        eviction = self._eviction_press()
        if isinstance(eviction, MASKING_PRESSES):
            reason = per_head_refusal(self.base_press)
            if reason is not None:
                raise ValueError(f"MergingDecodingPress with {type(eviction).__name__}'s per-head budgets: {reason}")
        elif not isinstance(self.base_press, BaseMergerPress):
            reason = unsupported_base_press_reason(type(self.base_press))
            if reason is not None or not isinstance(self.base_press, ScorerPress):
                raise ValueError(
                    f"base_press must be a merger or one of {SUPPORTED_BASE_PRESSES}; got "
                    f"{type(self.base_press).__name__}" + (f": {reason}" if reason else "")
                )
        self._check_room()
        self._streams: dict[int, _LayerStream] | None = None
        self._stream_start: int | None = None

    def _eviction_press(self) -> BasePress:
        """The eviction press that chooses the rows: the merger's base press, or the base press itself."""
        return self.base_press.press if isinstance(self.base_press, BaseMergerPress) else self.base_press

    def _check_room(self) -> None:
        """A one-line ValueError when ``target_size`` leaves no row to choose (every kept row protected) or the
        buffer is shorter than a scoring window."""
        merger = self.base_press if isinstance(self.base_press, BaseMergerPress) else None
        eviction = self._eviction_press()
        eviction = eviction.press if isinstance(eviction, AdaKVPress) else eviction
        protected = sum(len(span) for span in forced_score_ranges(eviction, 10**9))
        if isinstance(eviction, StreamingLLMPress):
            protected += eviction.n_sink
        needed, by = protected, f"{type(eviction).__name__}'s protected rows ({protected})"
        if merger is not None and hasattr(merger, "n_sink"):
            fixed = merger.n_sink + (merger.window_size if getattr(merger, "fix_window", False) else 0)
            if fixed > needed:
                needed, by = fixed, f"{type(merger).__name__}'s n_sink + window_size ({fixed})"
        if self.target_compression_ratio is None and self.target_size <= needed:
            raise ValueError(f"target_size must exceed {by}: got {self.target_size}")
        window = getattr(eviction, "window_size", None)
        for name in ("hidden_states_buffer_size", "compression_interval"):
            # NOTE: the buffer holds the tokens since the last compression (their rows may since have been evicted),
            # so the press scores with at most an interval's queries.
            if isinstance(window, int) and getattr(self, name) <= window:
                raise ValueError(
                    f"{name} must exceed {type(eviction).__name__}'s window_size ({window}), whose queries it scores "
                    f"with: got {getattr(self, name)}"
                )

    def post_init_from_model(self, model) -> None:
        self.base_press.post_init_from_model(model)

    def reset(self) -> None:
        self._streams = None
        self._stream_start = None

    @contextmanager
    def __call__(self, model):
        """kvpress's context manager: the press's state lives within it; padded batches are refused and
        sliding-window layers left whole, as by every merger."""
        options.check_options(self)
        self._check_room()
        if isinstance(self.base_press, AdaKVPress):
            refuse_eager(model)
        state = self.base_press.merging_state() if isinstance(self.base_press, BaseMergerPress) else nullcontext()
        self.reset()
        try:
            with state, padding_refused(model), BasePress.__call__(self, model):
                unhook_sliding_layers(self, model)
                yield
        finally:
            self.reset()

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        """After every forward of a layer: buffer its tokens' hidden states, and every ``compression_interval``
        tokens bring its cache back to the target."""
        cache = kwargs.get("past_key_values")
        if cache is None:
            return output
        hidden_states = kwargs["hidden_states"]
        layer = cache.layers[module.layer_idx]
        with torch.no_grad():
            stream = self._stream(module.layer_idx, kwargs, layer.keys)
            tokens = hidden_states.shape[1]
            stream.buffer(hidden_states, *kwargs["position_embeddings"], self.hidden_states_buffer_size)
            stream.seen += tokens
            stream.since_compression += tokens
            if stream.since_compression >= self.compression_interval:
                target = self.resolved_target_size(stream.seen)
                if isinstance(layer, PerHeadLayer) or isinstance(self.base_press, AdaKVPress):
                    self._compress_per_head(module, kwargs, cache, stream, target)
                elif layer.keys.shape[2] > target:
                    self._compress_layer(module, kwargs, layer, stream, target)
                stream.since_compression = 0
                stream.clear_buffer()
        return output

    def resolved_target_size(self, seen: int) -> int:
        """The rows a compression keeps once ``seen`` tokens have been streamed."""
        if self.target_compression_ratio is None:
            return self.target_size
        return max(1, int(seen * (1 - self.target_compression_ratio)))

    def kept_positions(self, layer_idx: int) -> torch.Tensor | None:
        """(B, H_kv, rows) the stream position of each row of layer ``layer_idx``'s cache (-1: cached before this
        press saw the stream), within the press's context; None before the layer's first forward, and once the layer
        holds each head's own rows (a per-head cache, whose positions are not kept)."""
        stream = (self._streams or {}).get(layer_idx)
        return None if stream is None or stream.per_head else stream.all_positions()

    def _stream(self, layer_idx: int, kwargs: dict, keys: torch.Tensor) -> _LayerStream:
        """The layer's state, made at its first forward in this context from the cache it finds."""
        if self._streams is None:
            self._streams = {}
        stream = self._streams.get(layer_idx)
        if stream is not None:
            return stream
        tokens = kwargs["hidden_states"].shape[1]
        earlier = keys.shape[2] - tokens
        if self._stream_start is None:
            # NOTE: the one read of the host per context: where the stream stands when the press first sees it (0
            # for a prefill from an empty cache, known from the shapes).
            positions = kwargs.get("position_ids")
            positions = positions if positions is not None else kwargs.get("cache_position")
            self._stream_start = 0 if earlier == 0 or positions is None else int(positions.reshape(-1)[0])
        start = self._stream_start
        known = start == earlier
        rows = (
            torch.arange(earlier, device=keys.device)
            if known
            else torch.full((earlier,), -1, dtype=torch.long, device=keys.device)
        )
        stream = _LayerStream(
            seen=start, positions=rows.expand(keys.shape[0], keys.shape[1], -1), positions_through=start
        )
        self._streams[layer_idx] = stream
        return stream

    def _compress_layer(self, module: nn.Module, kwargs: dict, layer, stream: _LayerStream, target: int) -> None:
        """Bring the layer's cache back to ``target`` rows, scoring (and merging) with the buffered tokens."""
        keys, values = layer.keys, layer.values
        rows = keys.shape[2]
        hidden_states, *embeddings = stream.recent(self.hidden_states_buffer_size)
        recent_kwargs = {**kwargs, "position_embeddings": tuple(embeddings)}
        # NOTE: a merger's ratio is its base press's; set for this compression only, so the press is unchanged after.
        saved = self.base_press.compression_ratio
        # NOTE: a ratio that kvpress's rounding (int(n·(1 − ratio))) turns into exactly ``target`` rows.
        self.base_press.compression_ratio = (rows - target - 0.5) / rows
        try:
            if isinstance(self.base_press, BaseMergerPress):
                keys, values = self.base_press.compress_recent(module, hidden_states, keys, values, recent_kwargs)
                kept = module.kept_positions
            else:
                selection = select_tokens(self.base_press, module, hidden_states, keys, values, None, recent_kwargs)
                kept = selection.kept_positions()
                keys, values = gather_rows(kept, keys, values)
        finally:
            self.base_press.compression_ratio = saved
        layer.keys, layer.values = keys, values
        stream.positions, stream.positions_through = stream.all_positions().gather(-1, kept), stream.seen

    def _compress_per_head(self, module: nn.Module, kwargs: dict, cache, stream: _LayerStream, target: int) -> None:
        """Bring each head of the layer's per-head cache back to ``target`` rows (a uniform cache under
        ``AdaKVPress`` becoming one first), scoring with the buffered tokens."""
        reason = per_head_refusal(self.base_press)
        if reason is not None:
            raise ValueError(reason)
        layer = cache.layers[module.layer_idx]
        if not isinstance(layer, PerHeadLayer):
            batch, heads, rows, _ = layer.keys.shape
            every = torch.ones(batch, heads, rows, dtype=torch.bool, device=layer.keys.device)
            layer = PerHeadLayer.from_kept(layer.keys, layer.values, every, (rows,) * (batch * heads))
        hidden_states, *embeddings = stream.recent(self.hidden_states_buffer_size)
        recent_kwargs = {**kwargs, "position_embeddings": tuple(embeddings)}
        cache.layers[module.layer_idx] = compress_per_head_layer(
            self.base_press, module, layer, hidden_states, recent_kwargs, target
        )
        stream.per_head = True


# NOTE: the options' documentation is their ``OptionSpec``s' (``grkv_core.options``), the one source of their help.
MergingDecodingPress.__doc__ = MergingDecodingPress.__doc__.rstrip() + "\n" + options_docstring(DecodingOptions)
