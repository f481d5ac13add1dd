"""Where and how a model is loaded: the device, the parameter dtype and the attention kernel."""

from __future__ import annotations

import importlib.util

import torch

from grkv_core.config import DEVICES

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def check_choice(argument: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{argument}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}")


def resolve_device(device: str) -> torch.device:
    check_choice("device", device, DEVICES)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch sees no CUDA device; use 'cpu' or 'auto'")
    return torch.device(device)


def resolve_attn_implementation(requested: str | None, device: torch.device, dtype: torch.dtype) -> str:
    if requested is not None:
        return requested
    flash_usable = (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and importlib.util.find_spec("flash_attn") is not None
    )
    return "flash_attention_2" if flash_usable else "sdpa"


def resolve_dtype(dtype: str, default: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return TORCH_DTYPES[dtype]
    # NOTE: on the CPU "auto" is float32: CPUs without bf16/fp16 matrix units emulate half-precision
    # matmuls (SmolLM2's 2K-token prefill: 23 s in bfloat16 against 4.6 s in float32 on the dev machine).
    return default if device.type == "cuda" else torch.float32
