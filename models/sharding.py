"""Tensor parallelism: which parameter is split over the mesh's ``"tp"`` axis, and how.

Megatron's split, as vLLM's ColumnParallelLinear / RowParallelLinear do it: q/k/v and the
MLP's gate/up are split by output columns (so each device holds whole heads and a slice of
the intermediate), o_proj and down_proj by input rows, and XLA's partitioner adds the one
all-reduce after each of those two. The embedding and the LM head are split by vocabulary
(vLLM's VocabParallelEmbedding / ParallelLMHead): a lookup becomes a masked local lookup
plus an all-reduce, and the engine gathers the logits once before sampling. Norms are
replicated. The KV cache is split the same way as k/v: each device keeps its own KV heads'
pages (``attend_paged`` runs per device under ``shard_map``).

Rules are ``(regex, spec)`` or ``(regex, spec, IF_DIVISIBLE)`` matched against a parameter's
dotted name (``model.layers.3.self_attn.q_proj.kernel``); the first match wins, no match
means replicated. ``spec`` names the mesh axis of each array axis, ``None`` for unsplit ones.
A split that does not divide raises, except under ``IF_DIVISIBLE``, which then replicates
(a vocabulary of 32001 stays whole instead of being refused). A model with other parameter
names sets a ``tp_partition_rules`` attribute of its own.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

TP_AXIS = "tp"

#: third element of a rule: replicate the parameter when the split does not divide
IF_DIVISIBLE = "if_divisible"

_COLUMN = r"(q_proj|k_proj|v_proj|gate_proj|up_proj)"
_ROW = r"(o_proj|down_proj)"

#: HF / Llama names: column-parallel q, k, v, gate, up; row-parallel o, down (nnx.Linear
#: kernels are [in, out]); embedding and LM head ([V, hidden] both) by vocabulary.
#: Quantized weights (``jaxkv.models.quant``) split with their kernels: an int8 / fp8 kernel
#: as the float one; per-output-channel ``scale [out]`` along the output axis (so replicated
#: for row-parallel o / down); per-block ``block_scale [in / block, out]`` along both (a
#: row-parallel shard holds whole blocks when ``in / tp`` divides by the block); the quantized
#: LM head's ``scale [V]`` / ``block_scale [V, hidden / block]`` by vocabulary, like its weight.
DEFAULT_TP_RULES: tuple[tuple, ...] = (
    (rf"\.{_COLUMN}\.kernel$", (None, TP_AXIS)),
    (rf"\.{_COLUMN}\.bias$", (TP_AXIS,)),
    (rf"\.{_COLUMN}\.scale$", (TP_AXIS,)),
    (rf"\.{_COLUMN}\.(block_scale|block_offset)$", (None, TP_AXIS)),
    (rf"\.{_ROW}\.kernel$", (TP_AXIS, None)),
    (rf"\.{_ROW}\.(block_scale|block_offset)$", (TP_AXIS, None)),
    (r"^lm_head\.weight$", (TP_AXIS, None), IF_DIVISIBLE),
    (r"^lm_head\.scale$", (TP_AXIS,), IF_DIVISIBLE),
    (r"^lm_head\.(block_scale|block_offset)$", (TP_AXIS, None), IF_DIVISIBLE),
    (r"^model\.embed_tokens\.embedding$", (TP_AXIS, None), IF_DIVISIBLE),
)


def check_device_count(size: int, devices=None) -> list:
    """The first ``size`` of ``devices`` (``jax.devices()`` by default). Raises ValueError
    for a size that is not a positive int or exceeds the devices; on CPU, more host devices
    come from ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before jax starts."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    if size > len(devices):
        hint = (
            "; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts"
            if devices and devices[0].platform == "cpu"
            else ""
        )
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} devices, jax sees {len(devices)}{hint}"
        )
    return devices[:size]


def make_tp_mesh(size: int, devices=None) -> Mesh:
    """A one-axis ``("tp",)`` mesh over the first ``size`` devices (``check_device_count``)."""
    return Mesh(np.array(check_device_count(size, devices)), (TP_AXIS,))


def param_name(path) -> str:
    """The dotted name rules match, from a ``jax.tree_util`` key path into an ``nnx.State``:
    ``model.layers.0.self_attn.q_proj.kernel``."""
    parts = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", None)))
        if name != "value":  # nnx.Variable's own leaf
            parts.append(str(name))
    return ".".join(parts)


def _match(name: str, ndim: int, rules) -> tuple[PartitionSpec, bool]:
    for pattern, spec, *flags in rules:
        if re.search(pattern, name):
            if len(spec) != ndim:
                raise ValueError(
                    f"tensor-parallel rule {pattern!r} gives {spec} for {name!r}, "
                    f"which has {ndim} axes"
                )
            return PartitionSpec(*spec), IF_DIVISIBLE in flags
    return PartitionSpec(), False


def partition_spec(name: str, ndim: int, rules=DEFAULT_TP_RULES) -> PartitionSpec:
    """The spec of parameter ``name`` (replicated when no rule matches).

    Example: ``partition_spec("model.layers.0.mlp.down_proj.kernel", 2)`` -> ``P("tp", None)``.
    """
    return _match(name, ndim, rules)[0]


def model_rules(model) -> tuple:
    """The rules for ``model`` (an instance or a class): its ``tp_partition_rules`` if it sets
    them, else DEFAULT_TP_RULES."""
    rules = getattr(model, "tp_partition_rules", None)
    return DEFAULT_TP_RULES if rules is None else rules


def param_sharding(
    name: str, shape: tuple[int, ...], mesh: Mesh, rules=DEFAULT_TP_RULES
) -> NamedSharding:
    """Where parameter ``name`` of ``shape`` lives on ``mesh``: its rule's spec, or replicated.

    Raises ValueError naming the parameter when a split axis does not divide by the ``"tp"``
    size (unless its rule says IF_DIVISIBLE: then it is replicated). Example, a 2-device mesh:
    ``param_sharding("model.layers.0.mlp.down_proj.kernel", (256, 128), mesh)`` ->
    ``NamedSharding(mesh, P("tp", None))``.
    """
    size = mesh.shape[TP_AXIS]
    spec, optional = _match(name, len(shape), rules)
    for axis, part in enumerate(spec):
        if part is not None and shape[axis] % size:
            if optional:
                return NamedSharding(mesh, PartitionSpec())
            raise ValueError(
                f"tensor_parallel_size={size} does not divide axis {axis} of {name} {list(shape)}"
            )
    return NamedSharding(mesh, spec)


def state_shardings(state, mesh: Mesh, rules=None):
    """``state`` (an ``nnx.State`` of arrays or ``jax.ShapeDtypeStruct``s, e.g. from an
    ``nnx.eval_shape`` model) with each leaf replaced by its ``param_sharding``: the
    ``out_shardings`` of a jitted init, or the shardings of abstract step arguments."""
    rules = DEFAULT_TP_RULES if rules is None else rules
    return jax.tree_util.tree_map_with_path(
        lambda path, x: param_sharding(param_name(path), tuple(x.shape), mesh, rules), state
    )


def shard_state(state, mesh: Mesh, rules=None):
    """``state`` (an ``nnx.State``) with every array placed on ``mesh`` by ``rules``
    (the model's ``tp_partition_rules``, else DEFAULT_TP_RULES). Raises ValueError naming a
    parameter whose split axis does not divide by the mesh size (unless its rule says
    IF_DIVISIBLE: then it is replicated). Arrays already placed so (``load_model(...,
    mesh=mesh)``) are not moved."""
    return jax.tree.map(jax.device_put, state, state_shardings(state, mesh, rules))
