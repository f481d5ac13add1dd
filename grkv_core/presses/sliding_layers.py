"""Sliding-window layers stay whole: every press compresses only a model's global-attention layers.

kvpress 0.5.5 skips the sliding-window layers of ``Gemma3ForConditionalGeneration`` alone and compresses those of
every other model, ``Gemma3ForCausalLM`` included. A compressed sliding-window layer breaks decoding: its mask counts
cache rows as positions, so the question attends to kept tokens far outside the window the layer was trained on
(Gemma 3 270M finds no needle at any budget that way, with or without a merge; docs/results/gemma3.md). Here a
layer is sliding when the model's configuration says so (``layer_types``, transformers' own record of it), and a press
applied through ``compressing`` (every evaluation here) or any merger of this package leaves it whole, for every
model: the budget (``compression_ratio``) is that of each global layer, and the sliding layers keep their full cache,
as in kvpress's multimodal Gemma 3.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

SLIDING_LAYER_TYPE = "sliding_attention"


def language_model(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM or of a multimodal model's text part (what holds ``layers``)."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def sliding_layer_indices(model: nn.Module) -> frozenset[int]:
    """The indices of ``model``'s sliding-window attention layers (its text configuration's ``layer_types``)."""
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or ()
    return frozenset(index for index, layer_type in enumerate(layer_types) if layer_type == SLIDING_LAYER_TYPE)


def unhook_sliding_layers(press, model: nn.Module) -> None:
    """Take the compression hook ``press(model)`` put on each sliding-window attention layer off again.

    Raises
    ------
    ValueError
        Every layer of ``model`` is sliding-window: nothing would be compressed.
    """
    sliding = sliding_layer_indices(model)
    if not sliding:
        return
    layers = language_model(model).layers
    if len(sliding) == len(layers):
        raise ValueError(
            f"every layer of {type(model).__name__} is sliding-window attention and sliding-window "
            "layers are never compressed: no layer is left for the press"
        )
    if model.config.get_text_config()._attn_implementation == "eager":
        # NOTE: transformers sizes one mask for all global layers from the cache's first layer (here a whole sliding
        # one); sdpa cuts the mask to each layer's keys, eager adds it as it is and fails at the first decoded token.
        raise ValueError(
            f"{type(model).__name__} mixes sliding-window and global layers: its sliding layers stay "
            "whole while the global ones are compressed, which transformers' eager attention cannot "
            "decode over (one mask for layers of two lengths); load it with sdpa (a press that needs "
            "eager attention, such as H2O, cannot run on it)"
        )
    for index in sliding:
        attention = layers[index].self_attn
        for hook_id, hook in list(attention._forward_hooks.items()):
            if hook == press.forward_hook:
                # NOTE: what kvpress's own RemovableHandle.remove() does at exit, which then finds nothing to remove.
                del attention._forward_hooks[hook_id]
                attention._forward_hooks_with_kwargs.pop(hook_id, None)
                attention._forward_hooks_always_called.pop(hook_id, None)


@contextmanager
def compressing(press, model: nn.Module):
    """``press(model)`` with the model's sliding-window layers left whole; nothing at all for ``press`` None (the
    full cache)."""
    if press is None:
        yield
        return
    with press(model):
        unhook_sliding_layers(press, model)
        yield
