"""Llama family: Llama 2/3, Mistral (sliding window), Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Pre-norm decoder layer (HF LlamaDecoderLayer):
  h = h + o_proj(attend(rope(q, k), v))  on input_layernorm(h)
  h = h + mlp(post_attention_layernorm(h))          # SwiGLU
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from jaxkv.models.attention import Attention
from jaxkv.models.config import ModelConfig
from jaxkv.models.layers import GatedMLP, RMSNorm
from jaxkv.models.transformer import CausalLM


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
        c = config
        self.self_attn = Attention(c, layer_idx, rngs=rngs)
        self.mlp = GatedMLP(
            c.hidden_size, c.intermediate_size, act=c.hidden_act, param_dtype=c.dtype, rngs=rngs
        )
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=c.dtype)
        self.post_attention_layernorm = RMSNorm(
            c.hidden_size, eps=c.rms_norm_eps, param_dtype=c.dtype
        )

    def __call__(
        self,
        h: jax.Array,  # [..., T, hidden]
        positions: jax.Array,  # [..., T] int32
        attend: Callable,  # (q, k, v) -> (o [..., T, Hq, D], aux)
    ) -> tuple[jax.Array, object]:  # [..., T, hidden], aux
        q, k, v = self.self_attn.project(self.input_layernorm(h), positions)
        o, aux = attend(q, k, v)
        h = h + self.self_attn.output(o)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, aux


class LlamaForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer
    embed_scale = False
