"""Bounded caches: how one stays bounded while the model decodes (``DecodingOptions``, ``MergingDecodingPress``'s
options, a ``PressConfig``'s ``decoding``) and the protocols that measure it (``grkv_core.config.StreamConfig``).

NOTE: imports nothing heavy, like ``grkv_core.options``: the command line and sweep configs read these specs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grkv_core.option_specs import OptionSpec, option, option_specs


@dataclass
class DecodingOptions:
    """How a cache stays bounded while the model decodes (``MergingDecodingPress``), named as kvpress's
    ``DecodingPress`` and ``CompressionRatioDecodingPress`` name them."""

    compression_interval: int = option(
        512,
        OptionSpec(
            "tokens between two compressions of a layer: every so many new tokens the cache is brought back to its "
            "target",
            int,
            low=1,
        ),
    )
    target_size: int = option(
        2048, OptionSpec("tokens each layer keeps after a compression (the bounded cache's size)", int, low=1)
    )
    target_compression_ratio: float | None = option(
        None,
        OptionSpec(
            "instead of target_size, the fraction of all tokens seen so far that a compression removes (kvpress's "
            "CompressionRatioDecodingPress); None: target_size",
            float,
            low=0.0,
            high=1.0,
            high_open=True,
            nullable=True,
        ),
    )
    hidden_states_buffer_size: int = option(
        256,
        OptionSpec(
            "the most recent tokens whose hidden states are kept between compressions: the base press scores with "
            "them and GRKV's surrogate queries are theirs",
            int,
            low=1,
        ),
    )


# The bounded-cache protocols (``grkv_core.evaluation.streaming``): a long text teacher-forced through a bounded cache,
# every streamed token scored; or a benchmark's context streamed into a bounded cache, then its question and reference
# answer scored (the answer metrics).
STREAM_NLL = "stream_nll"
STREAM_ANSWER = "stream_answer"
STREAM_PROTOCOLS = (STREAM_NLL, STREAM_ANSWER)
STREAM_PROTOCOL_SPEC = OptionSpec(
    "the bounded-cache protocol: stream_nll scores every token of long texts streamed through the cache; "
    "stream_answer streams a benchmark's context into it, then scores the reference answer",
    str,
    choices=STREAM_PROTOCOLS,
)


def check_decoding(decoding: Any, where: str = "decoding") -> None:
    """Raise a one-line ValueError unless ``decoding`` is a mapping of ``DecodingOptions`` names to values their
    specs accept."""
    specs = option_specs(DecodingOptions)
    if not isinstance(decoding, dict) or set(decoding) - set(specs):
        raise ValueError(f"{where} must be a mapping of some of {list(specs)}, got {decoding!r}")
    for name, value in decoding.items():
        specs[name].check(f"{where}.{name}", value)
