"""``build_model``: a config's model class with deterministic random weights."""

from __future__ import annotations

from flax import nnx

from models.config import ModelConfig
from models.hybrid import Gemma2ForCausalLM
from models.llama import LlamaForCausalLM
from models.transformer import CausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {"llama": LlamaForCausalLM, "gemma2": Gemma2ForCausalLM}


def build_model(config: ModelConfig, *, rngs: nnx.Rngs | None = None, seed: int = 0) -> CausalLM:
    """Random init (normal, std 1/sqrt(fan_in); norms at identity) from ``rngs`` or ``seed``.

    Same config and seed -> bit-identical weights. Load real weights afterwards with
    ``load_hf_weights``.
    """
    if rngs is None:
        rngs = nnx.Rngs(params=seed)
    return MODEL_CLASSES[config.architecture](config, rngs=rngs)
