"""Merging presses and per-head caches refuse padded batches: a merge fits every query and key of the prompt, pad
tokens included, and attention over a per-head cache builds its own causal mask, which knows no padding."""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch import nn

from grkv_core.presses.sliding_layers import language_model

MERGED_PADDING = (
    "merging presses do not support padded batches: the attention_mask marks padding, which would be merged into "
    "the cache"
)


@contextmanager
def padding_refused(model: nn.Module, refusal: str = MERGED_PADDING):
    """Within it, a forward of ``model`` whose attention mask marks padding stops in one line (``refusal``, then what
    to do), before any layer."""
    guard = language_model(model).register_forward_pre_hook(
        functools.partial(refuse_padding, refusal=refusal), with_kwargs=True
    )
    try:
        yield
    finally:
        guard.remove()


def refuse_padding(module: nn.Module, args: tuple, kwargs: dict, refusal: str = MERGED_PADDING) -> None:
    """Forward pre-hook: stop a forward whose 2-D attention mask marks padding."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.all()):
        raise ValueError(
            f"{refusal}; compress each sequence on its own (batch 1) or batch sequences of equal length without padding"
        )
