"""Every merger's options, defined once as ``OptionSpec`` fields of an options dataclass (``GRKVOptions`` and the
baselines'), whose checks, defaults and help the presses inherit and the command line, sweep configs, MLflow params
and reports derive from; and the solver's options (``SolverOptions``).

NOTE: imports nothing heavy, like ``grkv_core.config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

from grkv_core.catalog import QUERY_POLICIES
from grkv_core.option_specs import OptionSpec, check_options, option, option_specs

# The paper's window: its surrogate queries are the last 32 prompt positions (m), and it pairs GRKV with
# SnapKV's 32-token observation window; the reconstruction probe measures the window loss on as many.
PAPER_WINDOW = 32

COMPONENTS = ("kv", "k", "v")
RIDGE_SCALES = ("absolute", "relative")
ACCEPT_RULES = ("always", "objective", "validation")
HEAD_WEIGHTINGS = ("uniform", "o_proj")
MERGED_LAYERS = ("all", "early", "late")
MERGE_STREAMS = ("serial", "side")


@dataclass
class GRKVOptions:
    """GRKV's options (``GRKVPress`` fields besides the base press). Defaults are the library's; see
    ``PAPER_GRKV_OPTIONS`` for the paper's Alg. 1 exactly.

    NOTE: the defaults are the configuration that docs/results/default-rule.md's rule chose (2026-11-28, `sweep-qag2`:
    no candidate was better than the base press in half of its 16 cells, and of those worse in none this one gained
    the most): stratified queries, m = 64, the question-agnostic hypotheses sweep's ridges, β and key cap, and the
    loss rows weighted by the output projection. ``WINDOW32_GRKV_OPTIONS`` is the default before it.

    NOTE: the ridges are relative to the query policy's loss weight: a policy weighs each of its m loss rows w
    (``QueryPolicy.row_weight``: 1 for ``"window"``, the authors' code's 6/m for the others), and the regression
    minimises w·loss + λ·ridge, the plain loss with a ridge λ/w. The same ``lambda_k`` and ``lambda_v`` are thus an
    effective ridge m/6 times larger under ``"stratified"``, ``"mixture"`` and ``"expected"`` than under ``"window"``
    (5.3× at m = 32, 10.7× at m = 64), as in the authors' code.

    NOTE: not frozen, because ``GRKVPress`` inherits these fields and kvpress presses are mutable.
    """

    lambda_k: float = option(
        2.498e-3,
        OptionSpec(
            "ridge coefficient of the keys (paper: 1e-2 for Llama, 1e-1 for Mistral and Qwen), relative to the query "
            "policy's loss weight w per row: the effective ridge is lambda/w (w = 1 for 'window', 6/m for the others)",
            float,
            low=0.0,
            symbol="λk",
        ),
    )
    lambda_v: float = option(
        1.32e-3,
        OptionSpec(
            "ridge coefficient of the values, relative to the loss weight as lambda_k", float, low=0.0, symbol="λv"
        ),
    )
    beta: float = option(
        8.825e-3,
        OptionSpec(
            "fraction of the kept tokens (besides sinks and the window) with the highest base-press scores that are "
            "held fixed",
            float,
            low=0.0,
            high=1.0,
            symbol="β",
        ),
    )
    window_size: int = option(64, OptionSpec("m, the number of surrogate query tokens", int, low=1, symbol="m"))
    steps: int = option(1, OptionSpec("S, the maximum number of alternating value/key steps", int, low=1, symbol="S"))
    n_sink: int = option(4, OptionSpec("the first n_sink positions are held fixed when kept", int, low=0))
    fix_window: bool = option(
        True,
        OptionSpec(
            "hold the last window_size positions fixed when kept (paper; off: the window's own tokens are refitted "
            "too)",
            bool,
        ),
    )
    components: str = option(
        "kv", OptionSpec("refit keys and values (GRKV), keys (GRK) or values (GRV)", str, choices=COMPONENTS)
    )
    query_policy: str = option(
        "stratified",
        OptionSpec(
            "surrogate queries: the last m prompt tokens (paper), strata of the prompt (authors' code), half of each "
            "('mixture'), or draws from the queries' mean and covariance at future positions ('expected', as kvpress's "
            "ExpectedAttentionPress estimates them); all but 'window' weigh each loss row 6/m (the authors' code's "
            "weight), an effective ridge m/6 times lambda",
            str,
            choices=QUERY_POLICIES,
        ),
    )
    max_rel_update_k: float | None = option(
        0.1,
        OptionSpec(
            "trust-region cap per head, |dK| <= cap |K0| (authors' code: 0.025)",
            float,
            low=0.0,
            low_open=True,
            nullable=True,
        ),
    )
    max_rel_update_v: float | None = option(
        None,
        OptionSpec(
            "trust-region cap per head, |dV| <= cap |V0| (authors' code: 0.1)",
            float,
            low=0.0,
            low_open=True,
            nullable=True,
        ),
    )
    accept: str = option(
        "always",
        OptionSpec(
            "'objective' keeps, per head, the best of evicted / values-only / full merge (authors' code); "
            "'validation' merges a head only where a merge fitted on half the window's tokens lowers the loss on the "
            "other half",
            str,
            choices=ACCEPT_RULES,
        ),
    )
    cg_max_iter: int = option(4, OptionSpec("conjugate-gradient iteration cap of the key step", int, low=1))
    cg_rtol: float = option(
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
    safeguard: bool = option(
        True, OptionSpec("shorten the key step where it would raise the window loss (off: the paper's Alg. 1)", bool)
    )
    ridge_scale: str = option(
        "absolute",
        OptionSpec("'relative' multiplies lambda by a per-head scale of its system", str, choices=RIDGE_SCALES),
    )
    layers_per_solve: int = option(
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
    target_from_forward: bool = option(
        True,
        OptionSpec(
            "take the regression target from the prefill's own attention outputs instead of recomputing it (with the "
            "window policy; the others' targets are always recomputed)",
            bool,
        ),
    )
    head_weighting: str = option(
        "o_proj",
        OptionSpec(
            "'o_proj' weights each query head's rows of the loss by its output projection's squared norm (what the "
            "next layer sees of its error), 'uniform' alike (paper)",
            str,
            choices=HEAD_WEIGHTINGS,
        ),
    )
    merged_layers: str = option(
        "all",
        OptionSpec(
            "which of the compressed layers GRKV merges: 'all' (paper), the first half ('early') or the second half "
            "('late'); the others keep the base press's eviction, unmerged",
            str,
            choices=MERGED_LAYERS,
        ),
    )
    merge_stream: str = option(
        "serial",
        OptionSpec(
            "'side' solves each group of layers on a side CUDA stream while the forward goes on through the later "
            "layers, joined before anything reads the cache (at the end of the prefill's forward); 'serial' solves it "
            "in line (the only way on the CPU; the same results either way)",
            str,
            choices=MERGE_STREAMS,
        ),
    )


GRKV_OPTION_SPECS: dict[str, OptionSpec] = option_specs(GRKVOptions)
# How tables, run names and figures name the options that have a symbol (``OptionSpec.symbol``).
OPTION_SYMBOLS: dict[str, str] = {name: spec.symbol for name, spec in GRKV_OPTION_SPECS.items() if spec.symbol}
GRKV_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(GRKVOptions)}

# The paper's Alg. 1 with its Sec. 4.1 defaults, every option written out, whatever the library's defaults: the
# last m = 32 prompt tokens as queries, λ = 1e-2, β = 0.1, one alternating step, no safeguard, the key step solved to
# convergence. Only how the work is batched (``layers_per_solve``, ``target_from_forward``, ``merge_stream``: the same
# results up to float rounding) is the library's. A sweep enqueues it first (the searched options among these) so every
# sweep is anchored to the paper; ``GRKVPress.paper`` and ``--preset paper`` build it.
PAPER_GRKV_OPTIONS: dict[str, Any] = {
    **GRKV_DEFAULTS,
    "lambda_k": 1e-2,
    "lambda_v": 1e-2,
    "beta": 0.1,
    "window_size": PAPER_WINDOW,
    "steps": 1,
    "n_sink": 4,
    "fix_window": True,
    "components": "kv",
    "query_policy": "window",
    "max_rel_update_k": None,
    "max_rel_update_v": None,
    "accept": "always",
    "cg_max_iter": 200,
    "cg_rtol": 1e-7,
    "safeguard": False,
    "ridge_scale": "absolute",
    "head_weighting": "uniform",
    "merged_layers": "all",
}
# The library's default until 2026-11-28, every option written out: the paper's queries (the last m = 32 prompt
# tokens) and ridges with the safeguard and a 4-iteration key step. The results of that date and before ran it.
WINDOW32_GRKV_OPTIONS: dict[str, Any] = {
    **PAPER_GRKV_OPTIONS,
    "cg_max_iter": 4,
    "cg_rtol": 1e-6,
    "safeguard": True,
}
# Named sets of GRKV's options (``--preset``, a sweep's ``preset``).
GRKV_PRESETS: dict[str, dict[str, Any]] = {"paper": PAPER_GRKV_OPTIONS, "window32": WINDOW32_GRKV_OPTIONS}

# NOTE: the ten options ``grkv_merge`` takes (the rest are the press's: which tokens, which queries, acceptance).
SOLVER_OPTION_NAMES = (
    "lambda_k",
    "lambda_v",
    "steps",
    "components",
    "cg_max_iter",
    "cg_rtol",
    "safeguard",
    "ridge_scale",
    "max_rel_update_k",
    "max_rel_update_v",
)
# NOTE: the solver's own default for the trust-region caps is no cap (the regression's solution as the paper's Alg. 1
# has it): ``grkv_merge`` called without them solves the plain regression, while ``GRKVPress`` passes its own
# (``GRKVOptions``: a key cap of 0.1 by default).
_SOLVER_DEFAULTS = {"max_rel_update_k": None, "max_rel_update_v": None}

SolverOptions = make_dataclass(
    "SolverOptions",
    [
        (item.name, item.type, field(default=_SOLVER_DEFAULTS.get(item.name, item.default), metadata=item.metadata))
        for item in fields(GRKVOptions)
        if item.name in SOLVER_OPTION_NAMES
    ],
    frozen=True,
    namespace={
        "__post_init__": check_options,
        "__module__": __name__,
        "__doc__": (
            "The solver's options (``grkv_merge``, ``solve_regression``): ``GRKVOptions``' fields of the same names, "
            "with their defaults (but no trust-region cap, the plain regression's solution) and specs, as one frozen "
            "value checked when made."
        ),
    },
)


@dataclass
class CaMOptions:
    """CaM's options (``CaMPress``)."""

    merge_budget: int = option(
        32, OptionSpec("m, the number of subsequent kept tokens each evicted value is spread over", int, low=1)
    )
    window_size: int = option(
        PAPER_WINDOW, OptionSpec("the number of last prompt queries whose attention weights the merge", int, low=1)
    )


@dataclass
class D2OOptions:
    """D2O's options (``D2OPress``)."""

    threshold: float = option(
        0.5, OptionSpec("minimum key cosine similarity for an evicted token to be merged", float, low=-1.0, high=1.0)
    )
    candidate_range: int | None = option(
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

    threshold: float = option(
        0.75, OptionSpec("cosine similarity that links two adjacent keys", float, low=-1.0, high=1.0)
    )
    sigma: float | None = option(
        None,
        OptionSpec(
            "a fixed Gaussian-kernel width in key units (None: adapted per merging set)",
            float,
            low=0.0,
            low_open=True,
            nullable=True,
        ),
    )


@dataclass
class KVPressMergingOptions:
    """kvpress's ``MergingPress`` options, with kvpress's defaults. NOTE: kvpress checks them with asserts; these specs
    refuse bad values in one line, as our mergers do."""

    similarity_threshold: float = option(
        0.0,
        OptionSpec(
            "minimum key cosine similarity of an evicted token to its survivor for its value to be merged",
            float,
            low=0.0,
            high=1.0,
        ),
    )
    merge_fraction: float = option(
        1.0,
        OptionSpec(
            "fraction of the evicted tokens, most similar first, whose values are merged",
            float,
            low=0.0,
            high=1.0,
            low_open=True,
        ),
    )
