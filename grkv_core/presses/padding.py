"""Merging presses refuse padded batches: a merge fits every query and key of the prompt, pad tokens included."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from grkv_core.presses.sliding_layers import language_model


@contextmanager
def padding_refused(model: nn.Module):
    """Within it, a forward of ``model`` whose attention mask marks padding stops in one line, before any layer."""
    guard = language_model(model).register_forward_pre_hook(refuse_padding, with_kwargs=True)
    try:
        yield
    finally:
        guard.remove()


def refuse_padding(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: a merging press fits every query and key of the prompt, so pad tokens would be fitted."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.all()):
        raise ValueError(
            "merging presses do not support padded batches: the attention_mask marks padding, which "
            "would be merged into the cache; compress each sequence on its own (batch 1) or batch "
            "sequences of equal length without padding"
        )
