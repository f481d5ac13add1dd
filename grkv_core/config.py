"""The project's vocabulary, defined once: names, GRKV's options with their checks, the paper's defaults, and
the press and evaluation configurations.

Everything else derives from this module: ``GRKVPress`` takes its fields from ``GRKVOptions``, the ``grkv``
command line builds one flag per option, a sweep's searchable parameters and their validation come from
``GRKV_OPTION_SPECS``, and MLflow logs the resolved options. A new GRKV option added here is reachable from the
command line and from a sweep config without touching either.

NOTE: this module imports nothing heavy (no torch, kvpress or transformers), so validating a sweep config or
parsing a command line stays instant; presses are built from a ``PressConfig`` by ``grkv_core.registry.build``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import Any

# Names: the registry (grkv_core.registry) maps each to its implementation; a test checks the two agree.
EVICTION_PRESS_NAMES = (
    "snapkv",
    "pyramidkv",
    "streamingllm",
    "h2o",
    "expected_attention",
    "knorm",
    "criticalkv",
    "adakv",
    "criticaladakv",
)
FULL_CACHE = "full"
MERGER_NAMES = ("none", "grkv", "cam", "d2o", "asymkv", "kvmerger", "kvpress_merging")
# "ruler": the offline generator; "ruler-hub": simonjegou/ruler; "longbench": Xnhyacinth/LongBench (both hub
# copies pinned to a revision).
DATASETS = ("ruler", "ruler-hub", "longbench")
DTYPES = ("auto", "bfloat16", "float16", "float32")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
DEVICES = ("auto", "cpu", "cuda")


# Metric families: the dataset's scorer, the reference answer teacher-forced on each cache
# (``grkv_core.evaluation.answer_metrics``), the reconstruction discrepancies (``grkv_core.evaluation.probe``) and
# what a press costs (time, memory, sizes).
BENCHMARK, ANSWER, RECONSTRUCTION, COST = "benchmark", "answer", "reconstruction", "cost"
# How an evaluation's summary (``grkv_core.evaluation.results.summarize``) holds a per-sample metric: the mean over
# the samples that have a value (under its ``costs``), or per task the mean over its samples, then the mean over
# the tasks (a sample's ``score``: the summary's ``tasks``, ``mean_score`` and ``mean_score_outside_window``).
SAMPLE_MEAN, TASK_MEAN = "sample_mean", "task_mean"


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its name, what it measures and how it is used.

    ``family`` is one of ``BENCHMARK``, ``ANSWER``, ``RECONSTRUCTION``, ``COST``. ``summary`` is how an evaluation's
    summary holds a per-sample metric (``SAMPLE_MEAN`` or ``TASK_MEAN``); None for a number the summary computes
    from the samples' scores. ``higher_is_better`` is its direction (else smaller is better). ``objective``: a sweep
    may optimise it; ``screening``: a screening stage may rank configurations by it (it needs no decoding).
    """

    name: str
    family: str
    help: str
    summary: str | None = SAMPLE_MEAN
    higher_is_better: bool = False
    objective: bool = False
    screening: bool = False


# Every metric, defined once; the tuples below are views of this table (a test holds them to it).
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("score", BENCHMARK, "a sample's mean score over its questions, 0-1", TASK_MEAN, higher_is_better=True),
    MetricSpec(
        "mean_score",
        BENCHMARK,
        "the mean over tasks of each task's mean sample score, 0-100",
        None,
        higher_is_better=True,
        objective=True,
    ),
    MetricSpec(
        "mean_score_outside_window",
        BENCHMARK,
        "mean_score over the samples whose answer lies outside the "
        "press's always-kept window (those inside score at any budget)",
        None,
        higher_is_better=True,
    ),
    MetricSpec(
        "answer_nll",
        ANSWER,
        "the reference answer's mean token NLL on the compressed cache (nats)",
        objective=True,
        screening=True,
    ),
    MetricSpec(
        "answer_kl",
        ANSWER,
        "the mean KL(full || compressed) over the reference answer's positions (nats)",
        objective=True,
        screening=True,
    ),
    MetricSpec(
        "answer_top1",
        ANSWER,
        "the fraction of the reference answer's positions whose top-1 token agrees with the full cache's",
        higher_is_better=True,
        objective=True,
    ),
    MetricSpec(
        "window_loss",
        RECONSTRUCTION,
        "the normalised discrepancy on the surrogate window's queries",
        objective=True,
        screening=True,
    ),
    MetricSpec(
        "heldout_loss",
        RECONSTRUCTION,
        "the normalised discrepancy on the first generated tokens' queries (needs decoding)",
        objective=True,
    ),
    MetricSpec(
        "question_loss",
        RECONSTRUCTION,
        "the normalised discrepancy on the question's own queries, teacher-forced on its reference answer",
        objective=True,
        screening=True,
    ),
    MetricSpec(
        "ttft_s",
        COST,
        "time to first token: the prefill with its compression, plus the first question (s)",
        objective=True,
    ),
    MetricSpec("prefill_s", COST, "the prefill with this press's compression (s)"),
    MetricSpec("decode_ms_per_token", COST, "decoding latency per generated token (ms)", objective=True),
    MetricSpec("kv_bytes", COST, "the bytes the compressed cache keeps", objective=True),
    MetricSpec("full_kv_bytes", COST, "the bytes of the full cache"),
    MetricSpec(
        "peak_memory_bytes", COST, "peak memory: the CUDA allocator's, or on the CPU the process's high-water mark"
    ),
    MetricSpec("wall_s", COST, "the sample's wall time, shared among the presses evaluated with it (s)"),
    MetricSpec("context_tokens", COST, "the prefill's length (tokens)"),
)
# The per-sample metrics whose mean over the samples an evaluation's summary holds under ``costs``.
SAMPLE_MEAN_METRICS = tuple(spec.name for spec in METRICS if spec.summary == SAMPLE_MEAN)
LOSS_METRICS = tuple(spec.name for spec in METRICS if spec.family == RECONSTRUCTION)
ANSWER_METRICS = tuple(spec.name for spec in METRICS if spec.family == ANSWER)
# NOTE: a summary's per-task scores (``score.<task>``) are scores too.
HIGHER_IS_BETTER = frozenset(spec.name for spec in METRICS if spec.higher_is_better)
SCREENING_METRICS = tuple(spec.name for spec in METRICS if spec.screening)
OBJECTIVE_METRICS = tuple(spec.name for spec in METRICS if spec.objective)

# The evaluation protocols (kvpress's): the context compressed alone, then the question appended to the
# compressed cache (kvpress's pipeline), or the question compressed together with the context (kvpress's
# evaluation ``query_aware``: context + question is the prefill, only the chat template's tail and the answer
# prefix follow), so the press's observation window and GRKV's surrogate queries are the question's.
QUESTION_AGNOSTIC = "question_agnostic"
QUERY_AWARE = "query_aware"
PROTOCOLS = (QUESTION_AGNOSTIC, QUERY_AWARE)

# The paper's window: its surrogate queries are the last 32 prompt positions (m), and it pairs GRKV with
# SnapKV's 32-token observation window; the reconstruction probe measures the window loss on as many.
PAPER_WINDOW = 32

COMPONENTS = ("kv", "k", "v")
RIDGE_SCALES = ("absolute", "relative")
QUERY_POLICIES = ("window", "stratified")
ACCEPT_RULES = ("always", "objective", "validation")
HEAD_WEIGHTINGS = ("uniform", "o_proj")
MERGED_LAYERS = ("all", "early", "late")


def is_number(value) -> bool:
    """A real number given as int or float (bool excluded, although it subclasses int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class OptionSpec:
    """What values one option takes, for checks, command-line flags and sweep validation.

    ``kind`` is float, int, bool or str (then ``choices`` lists the values). Numbers are bounded by ``low`` and
    ``high`` (inclusive unless ``low_open``/``high_open``); ``nullable`` also admits None. ``symbol`` is how tables
    and figures name the option (the paper's letter where it has one, else the option's name).
    """

    help: str
    kind: type
    choices: tuple = ()
    symbol: str | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False

    def accepts(self, value) -> bool:
        if value is None:
            return self.nullable
        if self.kind is bool:
            return isinstance(value, bool)
        if self.kind is str:
            return value in self.choices
        if self.kind is int and not (isinstance(value, int) and not isinstance(value, bool)):
            return False
        if not is_number(value) or not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        """The accepted values in words, e.g. "an integer >= 1" or "one of ('kv', 'k', 'v')"."""
        if self.kind is bool:
            text = "True or False"
        elif self.kind is str:
            text = f"one of {self.choices}"
        else:
            noun = "an integer" if self.kind is int else "a finite number"
            if self.low is not None and self.high is not None:
                text = (
                    f"{noun} in {'(' if self.low_open else '['}{self.low:g}, "
                    f"{self.high:g}{')' if self.high_open else ']'}"
                )
            elif self.low is not None:
                text = f"{noun} {'>' if self.low_open else '>='} {self.low:g}"
            else:
                text = noun
        return f"None or {text}" if self.nullable else text

    def check(self, name: str, value) -> None:
        if not self.accepts(value):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")


def _option(default, spec: OptionSpec):
    return field(default=default, metadata={"spec": spec})


@dataclass
class GRKVOptions:
    """GRKV's options (``GRKVPress`` fields besides the base press). Defaults are the library's; see
    ``PAPER_GRKV_OPTIONS`` for the paper's Alg. 1 exactly.

    NOTE: not frozen, because ``GRKVPress`` inherits these fields and kvpress presses are mutable.
    """

    lambda_k: float = _option(
        1e-2,
        OptionSpec(
            "ridge coefficient of the keys (paper: 1e-2 for Llama, 1e-1 for Mistral and Qwen)",
            float,
            low=0.0,
            symbol="λk",
        ),
    )
    lambda_v: float = _option(1e-2, OptionSpec("ridge coefficient of the values", float, low=0.0, symbol="λv"))
    beta: float = _option(
        0.1,
        OptionSpec(
            "fraction of the kept tokens (besides sinks and the window) with the highest base-press scores that are "
            "held fixed",
            float,
            low=0.0,
            high=1.0,
            symbol="β",
        ),
    )
    window_size: int = _option(
        PAPER_WINDOW, OptionSpec("m, the number of surrogate query tokens", int, low=1, symbol="m")
    )
    steps: int = _option(1, OptionSpec("S, the maximum number of alternating value/key steps", int, low=1, symbol="S"))
    n_sink: int = _option(4, OptionSpec("the first n_sink positions are held fixed when kept", int, low=0))
    fix_window: bool = _option(
        True,
        OptionSpec(
            "hold the last window_size positions fixed when kept (paper; off: the window's own tokens are refitted "
            "too)",
            bool,
        ),
    )
    components: str = _option(
        "kv", OptionSpec("refit keys and values (GRKV), keys (GRK) or values (GRV)", str, choices=COMPONENTS)
    )
    query_policy: str = _option(
        "window",
        OptionSpec(
            "surrogate queries: the last m prompt tokens (paper) or strata of the prompt (authors' code)",
            str,
            choices=QUERY_POLICIES,
        ),
    )
    max_rel_update_k: float | None = _option(
        None,
        OptionSpec(
            "trust-region cap per head, |dK| <= cap |K0| (authors' code: 0.025)",
            float,
            low=0.0,
            low_open=True,
            nullable=True,
        ),
    )
    max_rel_update_v: float | None = _option(
        None,
        OptionSpec(
            "trust-region cap per head, |dV| <= cap |V0| (authors' code: 0.1)",
            float,
            low=0.0,
            low_open=True,
            nullable=True,
        ),
    )
    accept: str = _option(
        "always",
        OptionSpec(
            "'objective' keeps, per head, the best of evicted / values-only / full merge (authors' code); "
            "'validation' merges a head only where a merge fitted on half the window's tokens lowers the loss on the "
            "other half",
            str,
            choices=ACCEPT_RULES,
        ),
    )
    cg_max_iter: int = _option(4, OptionSpec("conjugate-gradient iteration cap of the key step", int, low=1))
    cg_rtol: float = _option(
        1e-6,
        OptionSpec(
            "relative residual tolerance of the key step's conjugate gradients",
            float,
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
        ),
    )
    safeguard: bool = _option(
        True, OptionSpec("shorten the key step where it would raise the window loss (off: the paper's Alg. 1)", bool)
    )
    ridge_scale: str = _option(
        "absolute",
        OptionSpec("'relative' multiplies lambda by a per-head scale of its system", str, choices=RIDGE_SCALES),
    )
    layers_per_solve: int = _option(
        0,
        OptionSpec(
            "layers whose merges are solved together in one batched call, at the last of them; 0: every layer the "
            "press "
            "compresses, in as few calls as a bounded working set allows (results equal up to float rounding; more "
            "layers dispatch fewer operations)",
            int,
            low=0,
        ),
    )
    target_from_forward: bool = _option(
        True,
        OptionSpec(
            "take the regression target from the prefill's own attention outputs instead of recomputing it", bool
        ),
    )
    head_weighting: str = _option(
        "uniform",
        OptionSpec(
            "'o_proj' weights each query head's rows of the loss by its output projection's squared norm (what the "
            "next layer sees of its error), 'uniform' alike (paper)",
            str,
            choices=HEAD_WEIGHTINGS,
        ),
    )
    merged_layers: str = _option(
        "all",
        OptionSpec(
            "which of the compressed layers GRKV merges: 'all' (paper), the first half ('early') or the second half "
            "('late'); the others keep the base press's eviction, unmerged",
            str,
            choices=MERGED_LAYERS,
        ),
    )


def option_specs(options: type) -> dict[str, OptionSpec]:
    """``{name: spec}`` of an options dataclass's fields (those declared with ``_option``), in field order."""
    return {item.name: item.metadata["spec"] for item in fields(options) if "spec" in item.metadata}


def check_options(options) -> None:
    """Raise a ValueError naming the first option of ``options`` (a dataclass instance, e.g. a merger press) whose
    value its spec does not accept."""
    for name, spec in option_specs(type(options)).items():
        spec.check(name, getattr(options, name))


GRKV_OPTION_SPECS: dict[str, OptionSpec] = option_specs(GRKVOptions)
# How tables, run names and figures name the options that have a symbol (``OptionSpec.symbol``).
OPTION_SYMBOLS: dict[str, str] = {name: spec.symbol for name, spec in GRKV_OPTION_SPECS.items() if spec.symbol}
GRKV_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(GRKVOptions)}

# The paper's Alg. 1 (Sec. 4.1 defaults): no safeguard and the key step solved to convergence; a sweep enqueues
# it first (the searched options among these) so every sweep is anchored to the paper.
PAPER_GRKV_OPTIONS: dict[str, Any] = {**GRKV_DEFAULTS, "safeguard": False, "cg_max_iter": 200, "cg_rtol": 1e-7}

# NOTE: the eight options ``grkv_merge`` takes (the rest are the press's: which tokens, which queries, acceptance).
SOLVER_OPTION_NAMES = (
    "lambda_k",
    "lambda_v",
    "steps",
    "components",
    "cg_max_iter",
    "cg_rtol",
    "safeguard",
    "ridge_scale",
)

SolverOptions = make_dataclass(
    "SolverOptions",
    [
        (item.name, item.type, field(default=item.default, metadata=item.metadata))
        for item in fields(GRKVOptions)
        if item.name in SOLVER_OPTION_NAMES
    ],
    frozen=True,
    namespace={
        "__post_init__": check_options,
        "__module__": __name__,
        "__doc__": (
            "The solver's options (``grkv_merge``, ``solve_regression``): ``GRKVOptions``' fields of the same names, "
            "with their defaults and specs, as one frozen value checked when made."
        ),
    },
)


@dataclass
class CaMOptions:
    """CaM's options (``CaMPress``)."""

    merge_budget: int = _option(
        32, OptionSpec("m, the number of subsequent kept tokens each evicted value is spread over", int, low=1)
    )
    window_size: int = _option(
        PAPER_WINDOW, OptionSpec("the number of last prompt queries whose attention weights the merge", int, low=1)
    )


@dataclass
class D2OOptions:
    """D2O's options (``D2OPress``)."""

    threshold: float = _option(
        0.5, OptionSpec("minimum key cosine similarity for an evicted token to be merged", float, low=-1.0, high=1.0)
    )
    candidate_range: int | None = _option(
        None,
        OptionSpec(
            "only kept tokens at most this many positions away are candidates (None: every kept token)",
            int,
            low=1,
            nullable=True,
        ),
    )


@dataclass
class KVMergerOptions:
    """KVMerger's options (``KVMergerPress``)."""

    threshold: float = _option(
        0.75, OptionSpec("cosine similarity that links two adjacent keys", float, low=-1.0, high=1.0)
    )
    sigma: float | None = _option(
        None,
        OptionSpec(
            "a fixed Gaussian-kernel width in key units (None: adapted per merging set)",
            float,
            low=0.0,
            low_open=True,
            nullable=True,
        ),
    )


# Our mergers' options, declared as dataclasses whose fields the presses inherit (AsymKV has none).
MERGER_OPTIONS: dict[str, type] = {
    "grkv": GRKVOptions,
    "cam": CaMOptions,
    "d2o": D2OOptions,
    "kvmerger": KVMergerOptions,
}
# Every merger's options by name. NOTE: kvpress's own MergingPress checks its options with asserts; these specs refuse
# bad values in one line, as our mergers do (its defaults stay kvpress's).
MERGER_OPTION_SPECS: dict[str, dict[str, OptionSpec]] = {
    "none": {},
    **{merge: option_specs(options) for merge, options in MERGER_OPTIONS.items()},
    "asymkv": {},
    "kvpress_merging": {
        "similarity_threshold": OptionSpec(
            "minimum key cosine similarity of an evicted token to its survivor for its value to be merged",
            float,
            low=0.0,
            high=1.0,
        ),
        "merge_fraction": OptionSpec(
            "fraction of the evicted tokens, most similar first, whose values are merged",
            float,
            low=0.0,
            high=1.0,
            low_open=True,
        ),
    },
}
# Each option name once, in the order of the mergers (a flag, a searchable parameter). NOTE: a name two mergers share
# means the same kind of value in both (``window_size``: GRKV's m and CaM's window; ``threshold``: D2O's and
# KVMerger's cosine similarity), so one spec checks it; a test holds them to that.
MERGER_OPTION_NAMES: tuple[str, ...] = tuple(
    dict.fromkeys(name for specs in MERGER_OPTION_SPECS.values() for name in specs)
)


def mergers_taking(name: str) -> list[str]:
    """The mergers that have an option ``name``."""
    return [merge for merge, specs in MERGER_OPTION_SPECS.items() if name in specs]


# What a prefill holds (``PROTOCOLS``): checked wherever a protocol enters (configs, the evaluator, press files).
PROTOCOL_SPEC = OptionSpec(
    "the evaluation protocol: the context compressed alone (kvpress's pipeline) or with "
    "its question (kvpress's evaluation query_aware)",
    str,
    choices=PROTOCOLS,
)

# A sweep searches the budget and every merger's options (each applied to the mergers that take it).
COMPRESSION_RATIO_SPEC = OptionSpec(
    "fraction of the context's KV pairs removed", float, low=0.0, high=1.0, high_open=True
)
SEARCHABLE_SPECS: dict[str, OptionSpec] = {
    "compression_ratio": COMPRESSION_RATIO_SPEC,
    **{name: MERGER_OPTION_SPECS[mergers_taking(name)[0]][name] for name in MERGER_OPTION_NAMES},
}


@dataclass(frozen=True)
class PressConfig:
    """What compresses the cache: an eviction press by name, its budget, and an optional merger."""

    press: str = "snapkv"
    compression_ratio: float = 0.9
    merge: str = "none"
    merge_options: dict[str, Any] = field(default_factory=dict)
    variant: str | None = None

    def __post_init__(self) -> None:
        """Check every name and option against its spec (nothing is built, nothing heavy imported)."""
        if self.press == FULL_CACHE:
            if self.merge != "none" or self.merge_options:
                raise ValueError("press 'full' keeps the whole cache: it takes no merger or merger options")
            return
        if self.press not in EVICTION_PRESS_NAMES:
            raise ValueError(f"unknown press {self.press!r}; choose from {[FULL_CACHE, *EVICTION_PRESS_NAMES]}")
        COMPRESSION_RATIO_SPEC.check("compression_ratio", self.compression_ratio)
        if self.merge not in MERGER_NAMES:
            raise ValueError(f"unknown merge {self.merge!r}; choose from {list(MERGER_NAMES)}")
        specs = MERGER_OPTION_SPECS[self.merge]
        unknown = set(self.merge_options) - set(specs)
        if unknown:
            valid = f"valid: {sorted(specs)}" if specs else "it takes none"
            raise ValueError(f"unknown option(s) {sorted(unknown)} for merge {self.merge!r}; {valid}")
        for name, value in self.merge_options.items():
            specs[name].check(name, value)

    @property
    def label(self) -> str:
        if self.press == FULL_CACHE:
            return FULL_CACHE
        budget = f"{1 - self.compression_ratio:.0%}"
        merger = "" if self.merge == "none" else f" + {self.variant or self.merge}"
        return f"{self.press} {budget}{merger}"


@dataclass(frozen=True)
class EvalConfig:
    """Everything that determines an evaluation's results (and so whether a run can be resumed).

    ``loss_window`` is the number of last prompt positions whose queries measure the window discrepancy,
    and ``heldout_tokens`` the number of first generated tokens whose queries measure the held-out one.
    ``protocol`` is one of ``PROTOCOLS``; files written before it existed were question-agnostic.
    ``decode``: answers are generated and scored; False: only what needs no generation (the reference answer's
    metrics, the window and question losses, the costs of the prefill), about a tenth of the time.
    NOTE: ``loss_window`` is the probe's, not the press's surrogate window (GRKV's ``window_size``, m): it
    stays fixed while a sweep searches m, so every trial's window loss is measured on the same queries.
    """

    model: str = "smollm2-135m"
    dataset: str = "ruler"
    tasks: tuple[str, ...] | None = None
    context_length: int | None = 2048
    samples: int = 5
    seed: int = 0
    press: PressConfig = field(default_factory=PressConfig)
    dtype: str = "auto"
    attn_implementation: str | None = None
    device: str = "auto"
    data_dir: str | None = None
    loss_window: int = PAPER_WINDOW
    heldout_tokens: int = 8
    protocol: str = QUESTION_AGNOSTIC
    decode: bool = True

    def __post_init__(self) -> None:
        PROTOCOL_SPEC.check("protocol", self.protocol)
        if not isinstance(self.decode, bool):
            raise ValueError(f"decode must be True or False, got {self.decode!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> EvalConfig:
        known = {f.name for f in fields(cls)} | {"window_size"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown evaluation config field(s): {sorted(unknown)}")
        data = dict(data)
        if "window_size" in data:  # NOTE: result files written before the rename (same meaning)
            data["loss_window"] = data.pop("window_size")
        data["press"] = PressConfig(**data.get("press", {}))
        if data.get("tasks") is not None:
            data["tasks"] = tuple(data["tasks"])
        return cls(**data)

    def resume_key(self) -> dict:
        """The fields a resumed run must share with the stored one (more samples may be added)."""
        key = self.to_dict()
        key.pop("samples")
        key["tasks"] = list(key["tasks"]) if key["tasks"] is not None else None
        return key
