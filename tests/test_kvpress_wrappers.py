"""Every kvpress wrapper around every merger: it works, or it refuses the merger before any layer runs.

A wrapper is a press class of kvpress's exports whose constructor takes another press (found from its signature); a
merger is no ``ScorerPress``, so the wrappers that select tokens from their press's scores refuse it when built, by
kvpress's own assert. The few that check nothing when built are refused by the merger when they enter a model
(``BaseMergerPress.post_init_from_model``).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import inspect
import typing
from dataclasses import dataclass

import kvpress
import pytest
import torch
from conftest import tiny_model
from kvpress import BasePress, KnormPress, ScorerPress, SnapKVPress
from kvpress.utils import compute_n_kept
from test_kvpress_compat import CONTEXT, OUR_MERGERS, RATIO, merger_over, token_ids

from grkv_core.evaluation.generation import cache_lengths, prefill
from grkv_core.evaluation.shared_prefill import attention_modules
from grkv_core.presses import GRKVPress, PerLayerCompressionPress

WORKS, BUILT, ENTERED = "works", "refused when built", "refused on entering the model"


@dataclass(frozen=True)
class Wrapping:
    """A wrapper with a merger in one of its press parameters, and how it meets the merger.

    ``message`` is what a one-line refusal says (a regular expression; ``{wrapper}`` and ``{merger}`` stand for the
    classes' names); ``ratios`` are the two layers' compression ratios under a wrapping that works.
    """

    wrapper: type
    slot: str
    outcome: str
    message: str = ""
    ratios: tuple[float, ...] = (RATIO, RATIO)

    def build(self, merger: BasePress) -> BasePress:
        """The wrapper around ``merger``, with the arguments it requires besides its press (``REQUIRED_ARGUMENTS``)."""
        press = [merger] if self.slot == "presses" else merger
        return self.wrapper(**{self.slot: press}, **REQUIRED_ARGUMENTS.get(self.wrapper, {}))

    def __str__(self) -> str:
        return f"{self.wrapper.__name__}.{self.slot}"


# The arguments a wrapper requires besides its press (every other one has a default).
REQUIRED_ARGUMENTS = {
    kvpress.PerLayerCompressionPress: {"compression_ratios": [0.5, 0.75]},
    PerLayerCompressionPress: {"compression_ratios": [0.5, 0.75]},
}

# NOTE: kvpress's refusals are its asserts, whose messages are its own (KeyRerotationPress's is empty).
SELECTS_ITSELF = r"^{wrapper}\({merger}\(\.\.\.\)\) would select tokens itself, without merging them; "
KVPRESS_WRAPPINGS = [
    Wrapping(kvpress.AdaKVPress, "press", BUILT, "^AdaKVPress requires a ScorerPress as input$"),
    Wrapping(kvpress.BlockPress, "press", BUILT, "^BlockPress requires a ScorerPress$"),
    Wrapping(kvpress.CAMPress, "base_press", BUILT, "^DecodingPress requires a ScorerPress as input$"),
    Wrapping(kvpress.ChunkKVPress, "press", BUILT, "^ChunkKVPress requires a ScorerPress as input$"),
    Wrapping(kvpress.ChunkPress, "press", BUILT, "^ChunkPress requires a ScorerPress as input$"),
    Wrapping(kvpress.ComposedPress, "presses", WORKS),
    Wrapping(kvpress.CompressionRatioDecodingPress, "base_press", BUILT, "^DecodingPress requires a ScorerPress"),
    Wrapping(kvpress.CriticalAdaKVPress, "press", BUILT, "^CriticalAdaKVPress requires a ScorerPress as input$"),
    Wrapping(kvpress.CriticalKVPress, "press", BUILT, "^CriticalKVPress requires a ScorerPress as input$"),
    Wrapping(kvpress.DecodingPress, "base_press", BUILT, "^DecodingPress requires a ScorerPress as input$"),
    Wrapping(kvpress.DMSPress, "press", ENTERED, SELECTS_ITSELF + "{merger} cannot wrap it either"),
    Wrapping(kvpress.EntropyGatedChunkKVPress, "press", BUILT, "^ChunkKVPress requires a ScorerPress as input$"),
    Wrapping(kvpress.KeyRerotationPress, "press", BUILT, "^$"),
    Wrapping(kvpress.LUKVPress, "press", BUILT, "^LUKVPress requires a ScorerPress as input$"),
    Wrapping(kvpress.MergingPress, "press", BUILT, "^MergingPress requires a ScorerPress, got {merger}$"),
    Wrapping(
        kvpress.PerLayerCompressionPress, "press", BUILT, "^PerLayerCompressionPress requires a ScorerPress as input$"
    ),
    Wrapping(kvpress.PrefillDecodingPress, "decoding_press", ENTERED, r"would compress the cache while decoding.*"),
    Wrapping(kvpress.PrefillDecodingPress, "prefilling_press", WORKS),
]
# This package's PerLayerCompressionPress: kvpress's, which also takes a merger.
WRAPPINGS = KVPRESS_WRAPPINGS + [Wrapping(PerLayerCompressionPress, "press", WORKS, ratios=(0.5, 0.75))]


def names_a_press(annotation) -> bool:
    """Whether a parameter's annotation is a press class, or a union, optional or list of one."""
    if inspect.isclass(annotation):
        return issubclass(annotation, BasePress)
    return any(names_a_press(argument) for argument in typing.get_args(annotation))


def kvpress_wrapper_slots() -> set[tuple[type, str]]:
    """(class, parameter) for every public parameter of an exported kvpress press's constructor that takes a press
    (CompactorPress's private ``_leverage_press`` is its own part, not a press it wraps)."""
    classes = (getattr(kvpress, name) for name in kvpress.__all__)
    return {
        (kind, name)
        for kind in classes
        if inspect.isclass(kind) and issubclass(kind, BasePress)
        for name, annotation in typing.get_type_hints(kind.__init__).items()
        if name != "return" and not name.startswith("_") and names_a_press(annotation)
    }


def test_the_matrix_covers_every_press_parameter_of_every_kvpress_wrapper():
    assert kvpress_wrapper_slots() == {(wrapping.wrapper, wrapping.slot) for wrapping in KVPRESS_WRAPPINGS}


@pytest.mark.parametrize("wrapping", WRAPPINGS, ids=str)
@pytest.mark.parametrize("name", OUR_MERGERS)
def test_a_wrapper_around_a_merger_works_or_refuses_it_before_any_layer(name, wrapping):
    model = tiny_model("tiny-llama").model
    merger = merger_over(name, SnapKVPress(compression_ratio=RATIO))
    expected = wrapping.message.format(wrapper=wrapping.wrapper.__name__, merger=type(merger).__name__)
    if wrapping.outcome == BUILT:
        with pytest.raises(AssertionError, match=expected) as error:
            wrapping.build(merger)
        assert "\n" not in str(error.value)
        return
    press = wrapping.build(merger)
    if wrapping.outcome == ENTERED:
        with pytest.raises(ValueError, match=expected) as error:
            with press(model):
                pass
        assert "\n" not in str(error.value)
        assert not any(module._forward_hooks for module in attention_modules(model)), "no layer was hooked"
        return
    ids = token_ids(model.config.vocab_size, seed=5)
    merged = prefill(model, ids, press)
    assert cache_lengths(merged) == [compute_n_kept(CONTEXT, ratio) for ratio in wrapping.ratios]
    evicted = prefill(model, ids, wrapping.build(SnapKVPress(compression_ratio=RATIO)))
    assert cache_lengths(evicted) == cache_lengths(merged)
    assert not torch.equal(merged.layers[1].values.sort(dim=2).values, evicted.layers[1].values.sort(dim=2).values)


@pytest.mark.parametrize("name", OUR_MERGERS)
def test_a_composed_press_running_a_merger_after_another_press_is_refused_on_entering_the_model(name):
    model = tiny_model("tiny-llama").model
    press = kvpress.ComposedPress([KnormPress(compression_ratio=0.5), merger_over(name, SnapKVPress(RATIO))])
    merger = type(press.presses[1]).__name__
    with pytest.raises(
        ValueError,
        match=rf"^ComposedPress\({merger}\(\.\.\.\)\) would run the merger on a cache that another press already "
        r"compressed; .*put the merger first inside it instead: ComposedPress\(\[<merger>, \.\.\.\]\)$",
    ):
        with press(model):
            pass


@pytest.mark.parametrize("name", OUR_MERGERS)
def test_a_wrapper_past_its_assert_and_its_set_up_is_refused_at_its_first_layer(name):
    """Under ``python -O`` kvpress's asserts are gone, and kvpress's PerLayerCompressionPress calls no set-up: a
    ChunkPress built so around a merger asks the merger for scores, which it has none of."""
    model = tiny_model("tiny-llama").model
    chunk = kvpress.ChunkPress(SnapKVPress(compression_ratio=0.5))
    chunk.press = merger_over(name, SnapKVPress(compression_ratio=0.5))
    per_layer = kvpress.PerLayerCompressionPress(SnapKVPress(), compression_ratios=[0.5, 0.5])
    per_layer.press = chunk
    merger = type(chunk.press).__name__
    assert not isinstance(chunk.press, ScorerPress)
    expected = SELECTS_ITSELF.format(wrapper="ChunkPress", merger=merger) + rf"use {merger}\(ChunkPress\(\.\.\.\)\)$"
    with pytest.raises(ValueError, match=expected):
        prefill(model, token_ids(model.config.vocab_size), per_layer)


def test_a_merger_called_to_compress_while_decoding_refuses():
    """A decoding step caches more entries than it has tokens; a merger merges the prefill only."""
    model = tiny_model("tiny-llama").model
    merger = GRKVPress(SnapKVPress(compression_ratio=RATIO))
    keys = torch.zeros(1, model.config.num_key_value_heads, CONTEXT + 1, model.config.head_dim)
    hidden_states = torch.zeros(1, 1, model.config.hidden_size)
    with pytest.raises(ValueError, match="^a press around GRKVPress would compress the cache while decoding"):
        merger.compress(attention_modules(model)[0], hidden_states, keys, keys, None, {})


def test_per_layer_compression_press_sets_up_the_merger_for_the_model():
    """kvpress's wrapper does not forward ``post_init_from_model``; this package's does, so a GRKV that merges some
    layers only learns the model's layers and merges those (the others keep their evicted rows)."""
    model = tiny_model("tiny-llama").model
    ids = token_ids(model.config.vocab_size, seed=5)
    only_last = merger_over("grkv", SnapKVPress(), merged_layers="late")
    merged = prefill(model, ids, PerLayerCompressionPress(only_last, compression_ratios=[0.5, 0.5]))
    evicted = prefill(model, ids, PerLayerCompressionPress(SnapKVPress(), compression_ratios=[0.5, 0.5]))
    assert torch.equal(merged.layers[0].values.sort(dim=2).values, evicted.layers[0].values.sort(dim=2).values)
    assert not torch.equal(merged.layers[1].values.sort(dim=2).values, evicted.layers[1].values.sort(dim=2).values)


def test_other_presses_meet_kvpress_per_layer_checks():
    with pytest.raises(AssertionError, match="^compression_ratio can't be set in the provided press: .*AdaKVPress"):
        PerLayerCompressionPress(kvpress.AdaKVPress(SnapKVPress()), compression_ratios=[0.5, 0.5])
    with pytest.raises(AssertionError, match="^PerLayerCompressionPress requires a ScorerPress as input$"):
        PerLayerCompressionPress(kvpress.LUKVPress(SnapKVPress()), compression_ratios=[0.5, 0.5])
