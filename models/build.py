"""``build_model``: a config's model class with deterministic random weights."""

from __future__ import annotations

from flax import nnx

from jaxkv.models.config import ModelConfig
from jaxkv.models.hybrid import Gemma2ForCausalLM
from jaxkv.models.llama import LlamaForCausalLM
from jaxkv.models.transformer import CausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {"llama": LlamaForCausalLM, "gemma2": Gemma2ForCausalLM}


def build_model(config: ModelConfig, *, rngs: nnx.Rngs | None = None, seed: int = 0,
                abstract: bool = False) -> CausalLM:
    """Random init (normal, std 1/sqrt(fan_in); norms at identity) from ``rngs`` or ``seed``.

    Same config and seed -> bit-identical weights. ``abstract=True`` allocates nothing
    (``nnx.eval_shape``: parameters are shape/dtype placeholders) for a model whose every
    parameter ``load_hf_weights`` is about to set; such a model cannot run before that.
    """
    cls = MODEL_CLASSES[config.architecture]
    if abstract:
        return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(params=seed)))
    if rngs is None:
        rngs = nnx.Rngs(params=seed)
    return cls(config, rngs=rngs)
