"""``build_model``: a config's model class with deterministic random weights."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jaxkv.models.config import ModelConfig
from jaxkv.models.hybrid import Gemma2ForCausalLM, Gemma3ForCausalLM
from jaxkv.models.llama import LlamaForCausalLM
from jaxkv.models.quant import (
    QuantizedLinear,
    check_quantization,
    quantize_model,
    quantized_modules,
)
from jaxkv.models.sharding import model_rules, state_shardings
from jaxkv.models.transformer import CausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def build_model(
    config: ModelConfig,
    *,
    rngs: nnx.Rngs | None = None,
    seed: int = 0,
    abstract: bool = False,
    mesh=None,
    rules=None,
    quantization: str | None = None,
    quantization_block: int | None = None,
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

    ``quantization`` ("int8" / "fp8", ``jaxkv.models.quant``): the float init, then every
    linear kernel and the LM head quantized (per output channel, or per block of
    ``quantization_block`` inputs where that divides them); only the quantized weights are
    kept (with ``mesh``: in the same jitted program). The float weights of the same seed are
    ``build_model(config, seed=seed)``'s.
    """
    check_quantization(quantization)
    cls = MODEL_CLASSES[config.architecture]

    def make(rngs):
        return quantize_model(cls(config, rngs=rngs), quantization, quantization_block)

    if abstract:
        return nnx.eval_shape(lambda: make(nnx.Rngs(params=seed)))
    if mesh is not None:
        if rngs is not None:
            raise ValueError("build_model(mesh=...) initialises from seed; do not pass rngs")
        return _build_sharded(make, seed, mesh, model_rules(cls) if rules is None else rules)
    if rngs is None:
        rngs = nnx.Rngs(params=seed)
    return make(rngs)


def _build_sharded(make, seed: int, mesh, rules) -> CausalLM:
    def init():
        return nnx.split(make(nnx.Rngs(params=seed)))[1]

    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(params=seed))))
    state = jax.jit(init, out_shardings=state_shardings(abstract_state, mesh, rules))()
    return nnx.merge(graphdef, state)


def dequantized_model(model):
    """A float copy of a quantized ``model`` (a new model; ``model`` is untouched): every
    ``QuantizedLinear`` back to an ``nnx.Linear`` with the dequantized kernel, the quantized
    head to an untied float ``LMHead`` of the dequantized weight (the config says
    ``tie_word_embeddings=False`` then). The reference a quantized model is checked against:
    same weights, float arithmetic."""
    config = dataclasses.replace(model.config, tie_word_embeddings=False)
    ref = build_model(config, abstract=True)
    graphdef, state, rest = nnx.split(ref, nnx.Param, ...)
    flat = {}
    qmods = quantized_modules(model)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        owner = qmods.get(path[:-1])
        if owner is None:
            flat[path] = var[...]
        elif isinstance(owner, QuantizedLinear):
            if path[-1] == "kernel":
                flat[path] = owner.dequantized()
            elif path[-1] == "bias":
                flat[path] = var[...]
        elif path[-1] == "weight":
            flat[path] = owner.dequantized()
    updates = [(p, flat[p]) for p, _ in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(updates), rest)
