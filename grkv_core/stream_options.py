"""How a cache stays bounded while the model decodes: ``DecodingOptions``, the options of ``MergingDecodingPress``.

NOTE: imports nothing heavy, like ``grkv_core.options``: the command line and sweep configs read these specs.
"""

from __future__ import annotations

from dataclasses import dataclass

from grkv_core.options import OptionSpec, option


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
