"""orbax-checkpoint save/restore of a model's parameters: the fast path after a first
GGUF/safetensors load (no dequantization, no name mapping, no transposes).

Layout of a checkpoint directory::

    <dir>/config.json   the ModelConfig fields (checked on restore)
    <dir>/params/       orbax StandardCheckpointer tree of ``nnx.state(model, nnx.Param)``

Restoring builds the model abstractly (``nnx.eval_shape``: no random init, no memory) and
lets orbax allocate the parameters directly. Checkpoints of untied models saved before the LM
head became vocab-major (``lm_head.kernel [hidden, V]``, an ``nnx.Linear``) still restore: the
kernel is read and transposed into ``lm_head.weight [V, hidden]``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxkv.models.build import build_model
from jaxkv.models.config import ModelConfig
from jaxkv.models.sharding import model_rules, shard_state, state_shardings

PARAMS_SUBDIR = "params"
CONFIG_FILE = "config.json"


def _config_json(config: ModelConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config)))


def save_params(
    model: nnx.Module,
    path: str | os.PathLike,
    *,
    config: ModelConfig | None = None,
    overwrite: bool = False,
) -> Path:
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


def restore_params(
    config: ModelConfig, path: str | os.PathLike, *, mesh=None, rules=None
) -> nnx.Module:
    """Builds the model of ``config`` with the parameters saved under ``path``.

    With a ``"tp"`` mesh orbax restores each parameter straight into its
    ``jaxkv.models.sharding`` placement (``rules``, else the model's own or the defaults), so
    each device reads and holds its own shard.

    Raises:
      ValueError: no checkpoint at ``path``, or it was saved from a different config.
    """
    root = Path(path).expanduser().absolute()
    if not (root / PARAMS_SUBDIR).is_dir() or not (root / CONFIG_FILE).is_file():
        raise ValueError(
            f"no orbax checkpoint at {str(root)!r} (expected {PARAMS_SUBDIR}/ and {CONFIG_FILE})"
        )
    with open(root / CONFIG_FILE, encoding="utf-8") as f:
        saved = json.load(f)
    wanted = _config_json(config)
    diff = {k: (saved.get(k), v) for k, v in wanted.items() if saved.get(k) != v}
    if diff:
        raise ValueError(
            f"checkpoint at {str(root)!r} was saved for another config: {{field: (saved, wanted)}} = {diff}"
        )
    abstract = nnx.eval_shape(lambda: build_model(config, seed=0))
    graphdef, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree_util.tree_leaves(rest):
        # Non-parameter variables need concrete values: take them from a real build.
        graphdef, _, rest = nnx.split(
            build_model(config, seed=0, mesh=mesh, rules=rules), nnx.Param, ...
        )
    rules = model_rules(abstract) if rules is None else rules
    with ocp.StandardCheckpointer() as ckptr:
        saved_head = _saved_keys(ckptr, root / PARAMS_SUBDIR, "lm_head")
        if "kernel" in saved_head and "weight" not in saved_head:
            params = _restore_linear_lm_head(ckptr, root / PARAMS_SUBDIR, abstract_params)
            if mesh is not None:  # an old layout: restored whole, then placed
                params = shard_state(params, mesh, rules)
        else:
            if mesh is not None:
                abstract_params = jax.tree.map(
                    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                    abstract_params,
                    state_shardings(abstract_params, mesh, rules),
                )
            params = ckptr.restore(root / PARAMS_SUBDIR, abstract_params)
    return nnx.merge(graphdef, params, rest)


def _saved_keys(ckptr, path: Path, module: str) -> set:
    """Keys saved under ``module`` (empty when the metadata does not say)."""
    try:
        tree = ckptr.metadata(path).item_metadata.tree
    except (AttributeError, TypeError, ValueError, FileNotFoundError):
        return set()
    sub = tree.get(module) if isinstance(tree, Mapping) else None
    return set(sub) if isinstance(sub, Mapping) else set()


def _restore_linear_lm_head(ckptr, path: Path, abstract_params: nnx.State) -> nnx.State:
    """A checkpoint whose untied LM head is ``kernel [hidden, V]``: restored with that layout
    as the target, then the kernel transposed into ``weight [V, hidden]``."""
    target = nnx.to_pure_dict(abstract_params)
    weight = target["lm_head"]["weight"]  # [V, hidden]
    target["lm_head"] = {
        "kernel": jax.ShapeDtypeStruct(weight.shape[::-1], weight.dtype, sharding=weight.sharding)
    }
    pure = _strip_values(ckptr.restore(path, _with_values(target)))
    pure["lm_head"] = {"weight": pure["lm_head"]["kernel"].T}
    nnx.replace_by_pure_dict(abstract_params, pure)
    return abstract_params


def _with_values(tree):  # pure dict -> the saved layout, each leaf under "value"
    if isinstance(tree, Mapping):
        return {k: _with_values(v) for k, v in tree.items()}
    return {"value": tree}


def _strip_values(tree):  # the inverse of _with_values
    if isinstance(tree, Mapping):
        if set(tree) == {"value"} and not isinstance(tree["value"], Mapping):
            return tree["value"]
        return {k: _strip_values(v) for k, v in tree.items()}
    return tree
