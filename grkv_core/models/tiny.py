"""Tiny random test models: 2-layer GQA Llama, Mistral, Qwen3 and Gemma 3 with seeded weights and an offline
byte-level ChatML tokenizer; they need no files and load in well under a second."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from grkv_core.models.placement import resolve_attn_implementation, resolve_dtype

TINY_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "tiny-llama": LlamaConfig,
    "tiny-mistral": MistralConfig,
    "tiny-qwen3": Qwen3Config,
    "tiny-gemma3": Gemma3TextConfig,
}
_TINY_ARCHITECTURE: dict[str, Any] = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
}
# A seed per name so that tiny-llama and tiny-mistral, near-identical architectures, still differ in weights.
_TINY_WEIGHT_SEEDS = {"tiny-llama": 1234, "tiny-mistral": 1235, "tiny-qwen3": 1236, "tiny-gemma3": 1237}
# Gemma 3 270M's layout in small: a sliding-window layer (a window shorter than the tests' prompts) before a global
# one, a single KV head and a wider head; the softmax scale stays Gemma's query_pre_attn_scalar**-0.5 = 1/16, not
# head_dim**-0.5, so a press that assumes the latter is caught.
_TINY_GEMMA3_LAYOUT: dict[str, Any] = {
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 64,
    "num_key_value_heads": 1,
    "head_dim": 32,
}
_TINY_BOS, _TINY_PAD = "<s>", "</s>"
_CHATML_START, _CHATML_END = "<|im_start|>", "<|im_end|>"
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tiny_model(
    name: str, dtype: str, attn_implementation: str | None, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    tokenizer = byte_level_chatml_tokenizer(_TINY_ARCHITECTURE["max_position_embeddings"])
    special_token_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config_class = TINY_CONFIG_CLASSES[name]
    extra: dict[str, Any] = {}
    if config_class is MistralConfig:
        # Mistral-7B-v0.3, the real model this stands in for, attends over the full context.
        extra["sliding_window"] = None
    elif config_class is Gemma3TextConfig:
        extra.update(_TINY_GEMMA3_LAYOUT)
    config = config_class(vocab_size=len(tokenizer), **{**_TINY_ARCHITECTURE, **extra}, **special_token_ids)

    torch_dtype = resolve_dtype(dtype, torch.float32, device)
    attention = resolve_attn_implementation(attn_implementation, device, torch_dtype)
    # fork_rng keeps the caller's global RNG stream untouched while making the weights reproducible.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_WEIGHT_SEEDS[name])
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attention)
    return model.to(device), tokenizer


def byte_level_chatml_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
    """A lossless tokenizer with one token per byte plus ChatML specials, built without any download."""
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(byte_symbols)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_TINY_BOS,
        eos_token=_CHATML_END,
        pad_token=_TINY_PAD,
        additional_special_tokens=[_CHATML_START],
        chat_template=_CHATML_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
