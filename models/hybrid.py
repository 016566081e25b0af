"""Hybrid families (Gemma 2, Gemma 3): local sliding-window and global attention layers.

Layer i slides when ``config.layer_types[i] == "sliding_attention"`` (HF Gemma 2: even layers,
layer 0 local). Sandwich norms, all (1 + weight) RMSNorm (HF Gemma2DecoderLayer):
  h = h + post_attention_layernorm(o_proj(attend(...)))   on input_layernorm(h)
  h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))   # GeGLU (gelu tanh)
Embeddings are scaled by sqrt(hidden); attention logits are soft-capped by
``attn_logit_softcapping`` after sm_scale = query_pre_attn_scalar ** -0.5; final logits by
``final_logit_softcapping`` (in ``compute_logits``).

Gemma 3 (HF Gemma3DecoderLayer) is the same layer without soft-capping, with per-head q/k
(1 + weight) RMSNorm before RoPE, five local layers to each global one, and the local layers'
own RoPE base (``ModelConfig.layer_rope``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from jaxkv.models.attention import Attention
from jaxkv.models.config import ModelConfig
from jaxkv.models.layers import GatedMLP, RMSNorm
from jaxkv.models.transformer import CausalLM


class Gemma2DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
        c = config
        self.self_attn = Attention(c, layer_idx, rngs=rngs)
        self.mlp = GatedMLP(
            c.hidden_size, c.intermediate_size, act=c.hidden_act, param_dtype=c.dtype, rngs=rngs
        )

        def norm():
            return RMSNorm(c.hidden_size, eps=c.rms_norm_eps, unit_offset=True, param_dtype=c.dtype)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def __call__(
        self,
        h: jax.Array,  # [..., T, hidden]
        positions: jax.Array,  # [..., T] int32
        attend: Callable,  # (q, k, v) -> (o [..., T, Hq, D], aux)
    ) -> tuple[jax.Array, object]:  # [..., T, hidden], aux
        q, k, v = self.self_attn.project(self.input_layernorm(h), positions)
        o, aux = attend(q, k, v)
        h = h + self.post_attention_layernorm(self.self_attn.output(o))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h, aux


class Gemma2ForCausalLM(CausalLM):
    layer_cls = Gemma2DecoderLayer
    embed_scale = True


class Gemma3ForCausalLM(CausalLM):
    layer_cls = (
        Gemma2DecoderLayer  # the same sandwich-norm layer; q/k norm and RoPE from the config
    )
    embed_scale = True
