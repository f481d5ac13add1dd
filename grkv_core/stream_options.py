"""Bounded caches: how one stays bounded while the model decodes (``DecodingOptions``, ``MergingDecodingPress``'s
options) and what a bounded-cache evaluation runs (``StreamConfig``).

NOTE: imports nothing heavy, like ``grkv_core.options``: the command line and sweep configs read these specs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from grkv_core.catalog import NO_MERGER
from grkv_core.config import FULL_CACHE, PressConfig
from grkv_core.options import OptionSpec, option, option_specs


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


@dataclass(frozen=True)
class StreamConfig:
    """Everything that determines a bounded-cache evaluation's results (and so whether it can be resumed).

    ``press`` names the base press and merger (its ``compression_ratio`` is unused: the cache's size is
    ``target_size``, brought back every ``compression_interval`` tokens). ``source``: a long-text domain
    (``grkv_core.datasets.long_texts.LONG_TEXT_DOMAINS``) for ``stream_nll``, a dataset (``ruler``...) for
    ``stream_answer``; ``split`` the long texts' (``eval`` for reports, ``tune`` for sweeps); ``max_tokens`` cuts
    each text (and is RULER's context length). ``prefill_tokens``: None prefills ``target_size`` tokens.
    """

    protocol: str = STREAM_NLL
    press: PressConfig = field(default_factory=lambda: PressConfig("streamingllm", 0.0))
    target_size: int = 512
    compression_interval: int = 128
    model: str = "smollm2-135m"
    source: str = "essays"
    split: str = "eval"
    samples: int = 3
    min_tokens: int = 4096
    max_tokens: int = 8192
    prefill_tokens: int | None = None
    tasks: tuple[str, ...] | None = None
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    data_dir: str | None = None

    def __post_init__(self) -> None:
        STREAM_PROTOCOL_SPEC.check("protocol", self.protocol)
        for name in ("target_size", "compression_interval"):
            option_specs(DecodingOptions)[name].check(name, getattr(self, name))
        if self.samples < 1 or self.min_tokens < 1 or self.max_tokens < self.min_tokens:
            raise ValueError(
                f"samples and min_tokens must be >= 1 and max_tokens >= min_tokens, got {self.samples}, "
                f"{self.min_tokens}, {self.max_tokens}"
            )

    @property
    def label(self) -> str:
        if self.press.press == FULL_CACHE:
            return FULL_CACHE
        merger = "" if self.press.merge == NO_MERGER else f" + {self.press.variant or self.press.merge}"
        return f"{self.press.press} {self.target_size}{merger}"

    def to_dict(self) -> dict:
        return asdict(self)
