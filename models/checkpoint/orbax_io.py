"""orbax-checkpoint save/restore of a model's parameters: the fast path after a first
GGUF/safetensors load (no dequantization, no name mapping, no transposes).

Layout of a checkpoint directory::

    <dir>/config.json   the ModelConfig fields (checked on restore)
    <dir>/params/       orbax StandardCheckpointer tree of ``nnx.state(model, nnx.Param)``

Restoring builds the model abstractly (``nnx.eval_shape``: no random init, no memory) and
lets orbax allocate the parameters directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from models.build import build_model
from models.config import ModelConfig

PARAMS_SUBDIR = "params"
CONFIG_FILE = "config.json"


def _config_json(config: ModelConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config)))


def save_params(model: nnx.Module, path: str | os.PathLike, *, config: ModelConfig | None = None,
                overwrite: bool = False) -> Path:
    """Saves ``nnx.state(model, nnx.Param)`` (and ``config`` when given, else ``model.config``).

    Raises:
      ValueError: ``path`` exists and ``overwrite`` is False.
    """
    root = Path(path).expanduser().absolute()
    if root.exists() and not overwrite:
        raise ValueError(f"checkpoint directory {str(root)!r} already exists (pass overwrite=True)")
    config = config if config is not None else getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError("save_params needs a ModelConfig: pass config= or use a model with .config")
    root.mkdir(parents=True, exist_ok=True)
    params = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(root / PARAMS_SUBDIR, params, force=True)
        ckptr.wait_until_finished()
    with open(root / CONFIG_FILE, "w", encoding="utf-8") as f:
        json.dump(_config_json(config), f, indent=2)
    return root


def read_saved_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig a checkpoint directory was saved with."""
    config_path = Path(path).expanduser() / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"no {CONFIG_FILE} in orbax checkpoint directory {str(path)!r}")
    with open(config_path, encoding="utf-8") as f:
        return ModelConfig(**json.load(f))


def restore_params(config: ModelConfig, path: str | os.PathLike) -> nnx.Module:
    """Builds the model of ``config`` with the parameters saved under ``path``.

    Raises:
      ValueError: no checkpoint at ``path``, or it was saved from a different config.
    """
    root = Path(path).expanduser().absolute()
    if not (root / PARAMS_SUBDIR).is_dir() or not (root / CONFIG_FILE).is_file():
        raise ValueError(f"no orbax checkpoint at {str(root)!r} (expected {PARAMS_SUBDIR}/ and {CONFIG_FILE})")
    with open(root / CONFIG_FILE, encoding="utf-8") as f:
        saved = json.load(f)
    wanted = _config_json(config)
    diff = {k: (saved.get(k), v) for k, v in wanted.items() if saved.get(k) != v}
    if diff:
        raise ValueError(f"checkpoint at {str(root)!r} was saved for another config: {{field: (saved, wanted)}} = {diff}")
    abstract = nnx.eval_shape(lambda: build_model(config, seed=0))
    graphdef, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree_util.tree_leaves(rest):
        # Non-parameter variables need concrete values: take them from a real build.
        graphdef, _, rest = nnx.split(build_model(config, seed=0), nnx.Param, ...)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(root / PARAMS_SUBDIR, abstract_params)
    return nnx.merge(graphdef, params, rest)

