"""``build_model``: a config's model class with deterministic random weights."""

from __future__ import annotations

import jax
from flax import nnx

from jaxkv.models.config import ModelConfig
from jaxkv.models.hybrid import Gemma2ForCausalLM
from jaxkv.models.llama import LlamaForCausalLM
from jaxkv.models.sharding import model_rules, state_shardings
from jaxkv.models.transformer import CausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {"llama": LlamaForCausalLM, "gemma2": Gemma2ForCausalLM}


def build_model(
    config: ModelConfig,
    *,
    rngs: nnx.Rngs | None = None,
    seed: int = 0,
    abstract: bool = False,
    mesh=None,
    rules=None,
) -> CausalLM:
    """Random init (normal, std 1/sqrt(fan_in); norms at identity) from ``rngs`` or ``seed``.

    Same config and seed -> bit-identical weights. ``abstract=True`` allocates nothing
    (``nnx.eval_shape``: parameters are shape/dtype placeholders) for a model whose every
    parameter ``load_hf_weights`` is about to set; such a model cannot run before that.

    ``mesh`` (a ``"tp"`` mesh, ``jaxkv.models.sharding``): the init runs as one jitted
    program whose outputs are placed by ``rules`` (the model class's ``tp_partition_rules``,
    else DEFAULT_TP_RULES), so each device computes and holds only its own shard. The values
    are bit-identical to the init without a mesh (threefry is partitionable by default since
    jax 0.5, and ``layers.normal_init`` keeps XLA from refolding the scaling). Works when the
    mesh spans several processes (each computes its addressable shards). Not with ``rngs``.
    """
    cls = MODEL_CLASSES[config.architecture]
    if abstract:
        return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(params=seed)))
    if mesh is not None:
        if rngs is not None:
            raise ValueError("build_model(mesh=...) initialises from seed; do not pass rngs")
        return _build_sharded(cls, config, seed, mesh, model_rules(cls) if rules is None else rules)
    if rngs is None:
        rngs = nnx.Rngs(params=seed)
    return cls(config, rngs=rngs)


def _build_sharded(cls, config: ModelConfig, seed: int, mesh, rules) -> CausalLM:
    def init():
        return nnx.split(cls(config, rngs=nnx.Rngs(params=seed)))[1]

    graphdef, abstract_state = nnx.split(
        nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(params=seed)))
    )
    state = jax.jit(init, out_shardings=state_shardings(abstract_state, mesh, rules))()
    return nnx.merge(graphdef, state)
