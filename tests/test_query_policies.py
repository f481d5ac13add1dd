"""The surrogate-query policies (``grkv_core.presses.query_policies``) against a float64 reference that writes each
policy's rows out position by position and rotates them with the model's own rotary embedding at those positions; and a
policy defined here, registered by name alone, which the command line, sweep configs and ``GRKVPress`` then take."""

import copy
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from conftest import tiny_model
from kvpress import SnapKVPress
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

from grkv_core.catalog import QUERY_POLICIES
from grkv_core.cli import build_parser, main
from grkv_core.evaluation.generation import prefill
from grkv_core.presses import GRKVPress
from grkv_core.presses.query_policies import ExpectedQueries, QueryPolicy, QueryRows, query_policy, surrogate_queries
from grkv_core.presses.query_policies.expected import (
    EXPECTED_FUTURE_POSITIONS,
    EXPECTED_SINKS,
    EXPECTED_STATISTICS_TOKENS,
    standard_draws,
)
from sweeps.config import SweepConfig

LENGTH = 150


class FirstTokens(QueryPolicy):
    """A policy of the user's own: the first m prompt tokens' queries, rotated to the last position, non-causal."""

    name = "toy"

    def prompt_rows(self, m, length, device):
        return slice(0, m), m

    def rope_rows(self, cos, sin, m, length):
        return QueryRows(
            cos[:, -1:].expand(-1, m, -1), sin[:, -1:].expand(-1, m, -1), torch.arange(m, device=cos.device), None
        )


@pytest.fixture
def toy_policy():
    """``FirstTokens`` registered as ``"toy"`` for the test's duration."""
    QUERY_POLICIES.register("toy", FirstTokens)
    try:
        yield FirstTokens
    finally:
        QUERY_POLICIES.unregister("toy")


def layer_inputs(architecture, length=LENGTH, seed=0):
    """A tiny model's first attention layer and its prefill inputs: (model, module, hidden states, (cos, sin))."""
    model = tiny_model(architecture).model
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(seed))
    captured = {}

    def hook(module, args, kwargs, output):
        captured.update(hidden_states=kwargs["hidden_states"], position_embeddings=kwargs["position_embeddings"])

    module = model.model.layers[0].self_attn
    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        prefill(model, ids)
    finally:
        handle.remove()
    return model, module, captured["hidden_states"], captured["position_embeddings"]


def reference_rows(policy, m, length):
    """The policy's rows written out: [(token or None, position rotated to, causal position or None)], and for
    ``"expected"`` the statistics tokens."""
    last = length - 1
    if policy == "toy":
        return [(t, last, None) for t in range(m)], None
    if policy == "window":
        return [(t, t, t) for t in range(length - m, length)], None
    if policy == "stratified":
        return [(((2 * i + 1) * length) // (2 * m), last, None) for i in range(m)], None
    if policy == "mixture":
        window, strata = math.ceil(m / 2), m // 2
        before = length - window
        rows = [(t, t, t) for t in range(before, length)]
        return rows + [(((2 * i + 1) * before) // (2 * strata), last, last) for i in range(strata)], None
    future = min(EXPECTED_FUTURE_POSITIONS, length - 1)
    offsets = [math.ceil((j + 1) * future / m) for j in range(m)]
    stride = math.ceil((length - EXPECTED_SINKS) / EXPECTED_STATISTICS_TOKENS)
    statistics = list(range(EXPECTED_SINKS, length, stride))
    assert len(statistics) <= EXPECTED_STATISTICS_TOKENS
    return [(None, last + offset, None) for offset in offsets], statistics


def reference_queries(model, module, hidden_states, policy, m):
    """(B, H_kv, groups·m, d) float64 queries, (groups·m,) causal positions or None, the rows' loss weight."""
    module64 = copy.deepcopy(module).double()
    rotary = copy.deepcopy(model.model.rotary_emb).double()
    hidden64 = hidden_states.double()
    rows, statistics = reference_rows(policy, m, hidden_states.shape[1])
    if statistics is None:
        pre = get_prerope_query_states(module64, hidden64[:, [token for token, _, _ in rows]])
    else:
        queries = get_prerope_query_states(module64, hidden64[:, statistics])
        mean = queries.mean(dim=2, keepdim=True)
        pre = mean + standard_draws(m, len(statistics)).double() @ (queries - mean)
    rotated_to = torch.tensor([[position for _, position, _ in rows]])
    cos, sin = rotary(hidden64, rotated_to)
    post = pre * cos[:, None] + rotate_half(pre) * sin[:, None]
    groups = module.config.num_attention_heads // module.config.num_key_value_heads
    stacked = post.reshape(post.shape[0], module.config.num_key_value_heads, groups * m, -1)
    causal = [position for _, _, position in rows]
    positions = None if causal[0] is None else torch.tensor(causal * groups)
    return stacked, positions, 1.0 if policy in ("window", "toy") else 6.0 / m


@pytest.mark.parametrize("architecture", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("policy", list(QUERY_POLICIES))
@pytest.mark.parametrize("m", [1, 7, 32])
def test_each_policy_matches_its_float64_reference(architecture, policy, m):
    model, module, hidden_states, position_embeddings = layer_inputs(architecture)
    got = surrogate_queries(module, hidden_states, position_embeddings, policy=query_policy(policy), n_queries=m)
    want, positions, loss_weight = reference_queries(model, module, hidden_states, policy, m)
    torch.testing.assert_close(got.queries.double(), want, rtol=1e-4, atol=1e-5)
    if positions is None:
        assert got.positions is None
    else:
        assert torch.equal(got.positions.cpu(), positions)
    assert got.loss_weight == loss_weight
    assert got.token_positions.numel() == m


@pytest.mark.parametrize("length,m", [(40, 100), (2 * EXPECTED_STATISTICS_TOKENS + 60, 16)])
def test_the_expected_policy_draws_as_many_queries_as_asked_from_strided_statistics(length, m):
    # NOTE: 100 draws from a 40-token prompt (more than its length, rotated up to 39 positions past it), and a prompt
    # long enough that the statistics take every third token.
    model, module, hidden_states, position_embeddings = layer_inputs("tiny-llama", length=length)
    got = surrogate_queries(module, hidden_states, position_embeddings, policy=ExpectedQueries(), n_queries=m)
    want, _, _ = reference_queries(model, module, hidden_states, "expected", m)
    # NOTE: float32 RoPE tables round the angle p·θ to about p·2⁻²⁴ radians: past 2,000 positions, 1e-4 of |q|.
    torch.testing.assert_close(got.queries.double(), want, rtol=1e-4, atol=1e-5 * max(1, length / 400))
    future = min(EXPECTED_FUTURE_POSITIONS, length - 1)
    assert got.token_positions.min() == length - 1 + math.ceil(future / m)
    assert got.token_positions.max() == length - 1 + future


def test_the_expected_draws_have_the_statistics_queries_mean_and_covariance():
    statistics = torch.randn(1, 2, 50, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    statistics = statistics * torch.tensor([3.0, 1.0, 0.5, 0.1], dtype=torch.float64) + 2.0
    draws = ExpectedQueries().queries_from(statistics, 200_000)
    mean = statistics.mean(dim=2)
    centred = statistics - mean[:, :, None]
    covariance = centred.transpose(-1, -2) @ centred / 50
    torch.testing.assert_close(draws.mean(dim=2), mean, atol=0.03, rtol=0)
    drawn = draws - draws.mean(dim=2, keepdim=True)
    torch.testing.assert_close(drawn.transpose(-1, -2) @ drawn / draws.shape[2], covariance, atol=0.1, rtol=0.02)


def test_a_registered_policy_is_a_command_line_choice(toy_policy, capsys):
    with pytest.raises(SystemExit) as exit_status:
        main(["eval", "--help"])
    assert exit_status.value.code == 0
    assert "--query-policy {window,stratified,mixture,expected,toy}" in capsys.readouterr().out
    assert build_parser().parse_args(["eval", "--merge", "grkv", "--query-policy", "toy"]).query_policy == "toy"


def test_a_registered_policy_is_a_sweep_choice(toy_policy):
    space = {"query_policy": {"type": "categorical", "choices": ["toy", "window"]}}
    config = SweepConfig(name="toy", search_space=space, trials=1)
    assert config.search_space["query_policy"].choices == ["toy", "window"]
    with pytest.raises(ValueError, match="query_policy"):
        SweepConfig(name="toy", search_space={"query_policy": {"type": "categorical", "choices": ["nope"]}}, trials=1)


def test_a_registered_policy_matches_its_float64_reference(toy_policy):
    model, module, hidden_states, position_embeddings = layer_inputs("tiny-llama")
    got = surrogate_queries(module, hidden_states, position_embeddings, policy=query_policy("toy"), n_queries=7)
    want, _, loss_weight = reference_queries(model, module, hidden_states, "toy", 7)
    torch.testing.assert_close(got.queries.double(), want, rtol=1e-4, atol=1e-5)
    assert got.positions is None and got.loss_weight == loss_weight


def used_queries(model, ids, press):
    """The cache ``press`` leaves after a prefill of ``ids``, and the surrogate queries it used per layer, with the
    layer and its input."""
    used = []
    layer_context = press.layer_context

    def recording_layer_context(module, hidden_states, keys, kwargs):
        context = layer_context(module, hidden_states, keys, kwargs)
        used.append((context.surrogate.queries, module, hidden_states))
        return context

    press.layer_context = recording_layer_context
    return prefill(model, ids, press), used


def test_grkv_merges_with_a_registered_policy_and_uses_its_rows(toy_policy):
    model = tiny_model("tiny-llama").model
    ids = torch.randint(0, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(4))
    options = {"window_size": 8, "n_sink": 0, "beta": 0.0}
    evicted = prefill(model, ids, SnapKVPress(compression_ratio=0.5))
    toy, used = used_queries(
        model, ids, GRKVPress(press=SnapKVPress(compression_ratio=0.5), query_policy="toy", **options)
    )
    stratified = prefill(
        model, ids, GRKVPress(press=SnapKVPress(compression_ratio=0.5), query_policy="stratified", **options)
    )
    assert len(used) == len(toy.layers)
    for queries, module, hidden_states in used:
        want, _, _ = reference_queries(model, module, hidden_states, "toy", 8)
        torch.testing.assert_close(queries.double(), want, rtol=1e-4, atol=1e-5)
    for layer in range(len(toy.layers)):
        assert toy.layers[layer].values.shape == evicted.layers[layer].values.shape
        # NOTE: kvpress's eviction leaves the kept rows in score order and a merge in position order: compare sorted.
        assert not torch.equal(
            toy.layers[layer].values.sort(dim=2).values, evicted.layers[layer].values.sort(dim=2).values
        )
        assert not torch.equal(toy.layers[layer].values, stratified.layers[layer].values)


def test_a_policys_row_weight_divides_the_ridges(toy_policy, monkeypatch):
    # NOTE: w·loss + λ·ridge has the minimiser of loss + (λ/w)·ridge: a policy weighing its rows 4 with λ merges as one
    # weighing them 1 with λ/4.
    model = tiny_model("tiny-llama").model
    ids = torch.randint(0, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(5))

    def merged(lambda_, weight):
        monkeypatch.setattr(FirstTokens, "row_weight", lambda self, m: weight)
        press = GRKVPress(
            press=SnapKVPress(compression_ratio=0.5),
            query_policy="toy",
            window_size=8,
            lambda_k=lambda_,
            lambda_v=lambda_,
        )
        return prefill(model, ids, press)

    heavy, plain, other = merged(0.4, 4.0), merged(0.1, 1.0), merged(0.4, 1.0)
    for layer in range(len(heavy.layers)):
        assert torch.equal(heavy.layers[layer].keys, plain.layers[layer].keys)
        assert torch.equal(heavy.layers[layer].values, plain.layers[layer].values)
        assert not torch.equal(heavy.layers[layer].values, other.layers[layer].values)
