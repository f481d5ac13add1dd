"""SurrogateCapture on its own: what it keeps of a forward, checked against the layers' own projections recorded by
plain hooks."""

from contextlib import contextmanager

import pytest
import torch
from conftest import TINY_ARCHITECTURES, tiny_model

from grkv_core.presses.query_policies import query_policy
from grkv_core.presses.surrogate_capture import OUTPUTS_BEFORE_O_PROJ, SurrogateCapture

WINDOW = 8


@contextmanager
def recorded_calls(language_model):
    """Each layer's first q_proj output and o_proj input in the forwards inside, recorded by plain hooks (and the hooks'
    handles, to which a test may add its own: all are removed on exit)."""
    calls, handles = {}, []
    for layer in language_model.layers:
        attention = layer.self_attn

        def keep_q(module, args, output, index=attention.layer_idx):
            calls.setdefault(("q", index), output.detach().clone())

        def keep_o(module, args, index=attention.layer_idx):
            calls.setdefault(("o", index), args[0].detach().clone())

        handles += [attention.q_proj.register_forward_hook(keep_q), attention.o_proj.register_forward_pre_hook(keep_o)]
    try:
        yield calls, handles
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
@pytest.mark.parametrize(
    "policy,keep_outputs",
    [("window", True), ("window", False), ("stratified", False), ("mixture", False), ("expected", False)],
)
def test_it_keeps_the_rows_each_policy_reads_of_each_layers_queries_and_attention_outputs(
    architecture, policy, keep_outputs
):
    model = tiny_model(architecture).model
    language_model = model.model
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    capture = SurrogateCapture(query_policy(policy), WINDOW, keep_outputs=keep_outputs)
    rows, count = query_policy(policy).prompt_rows(WINDOW, ids.shape[1], ids.device)
    with recorded_calls(language_model) as (calls, _):
        with torch.no_grad(), capture.hooked([layer.self_attn for layer in language_model.layers]):
            language_model(input_ids=ids)
            for layer in language_model.layers:
                index = layer.self_attn.layer_idx
                projections, outputs = capture.take(index)
                assert isinstance(layer.self_attn, OUTPUTS_BEFORE_O_PROJ)
                assert projections.shape[1] == count
                torch.testing.assert_close(projections, calls["q", index][:, rows], rtol=0, atol=0)
                if keep_outputs:
                    torch.testing.assert_close(outputs, calls["o", index][:, rows], rtol=0, atol=0)
                else:
                    assert outputs is None
                assert capture.take(index) == (None, None), "handed over once"


def test_only_the_forwards_own_q_proj_call_is_kept_and_decoding_steps_are_not():
    model = tiny_model().model
    language_model = model.model
    attention = language_model.layers[0].self_attn
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    capture = SurrogateCapture(query_policy("window"), WINDOW, keep_outputs=True)

    def project_something_else(module, args, kwargs, output):
        # A base press scoring other tokens calls q_proj again after the forward's own call.
        module.q_proj(torch.randn_like(kwargs["hidden_states"]))

    with recorded_calls(language_model) as (calls, handles):
        handles.append(attention.register_forward_hook(project_something_else, with_kwargs=True))
        with torch.no_grad(), capture.hooked([layer.self_attn for layer in language_model.layers]):
            language_model(input_ids=ids)
            projections, _ = capture.take(0)
            torch.testing.assert_close(projections, calls["q", 0][:, -WINDOW:], rtol=0, atol=0)
            language_model(input_ids=ids[:, :1])  # one token: a decoding step
            assert capture.take(0) == (None, None)


def test_leaving_removes_its_hooks_and_forgets_what_it_kept():
    model = tiny_model().model
    language_model = model.model
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    hooks_before = [
        (
            len(layer.self_attn._forward_pre_hooks),
            len(layer.self_attn.q_proj._forward_hooks),
            len(layer.self_attn.o_proj._forward_pre_hooks),
        )
        for layer in language_model.layers
    ]
    capture = SurrogateCapture(query_policy("window"), WINDOW, keep_outputs=True)
    with torch.no_grad(), capture.hooked([layer.self_attn for layer in language_model.layers]):
        language_model(input_ids=ids)
    assert capture.take(0) == (None, None)
    assert hooks_before == [
        (
            len(layer.self_attn._forward_pre_hooks),
            len(layer.self_attn.q_proj._forward_hooks),
            len(layer.self_attn.o_proj._forward_pre_hooks),
        )
        for layer in language_model.layers
    ]
