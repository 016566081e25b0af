"""The decoder-only causal LM shared by both families; families differ only in their layer class.

Module tree (mirrors HF parameter names, see models/weights.py):
  model.embed_tokens, model.layers[i] (self_attn, mlp, norms), model.norm, lm_head (untied only)

Forward contract (vLLM's): ``__call__`` returns hidden states *after* the final norm;
``compute_logits`` applies the LM head (and Gemma 2's final soft-cap) to the rows that need
logits. Decoder layers take an ``attend(q, k, v) -> (o, aux)`` callable so the paged forward
and the dense reference share every projection and norm and differ only in attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.models.config import KVCacheBinding, LayerKVInfo, ModelConfig, layer_name
from jaxkv.models.layers import RMSNorm, normal_init
from jaxkv.models.quant import CPU_KERNEL_FLOAT_DTYPES, QuantizedLMHead, float_matmul
from jaxkv.pallas_kernels import AttentionMetadata


class DecoderStack(nnx.Module):
    """HF ``model``: token embedding, decoder layers, final norm."""

    def __init__(self, config: ModelConfig, layer_cls: type, *, embed_std: float, rngs: nnx.Rngs):
        h = config.hidden_size
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            h,
            dtype=config.dtype,
            param_dtype=config.dtype,
            embedding_init=normal_init(embed_std),
            rngs=rngs,
        )
        self.layers = nnx.List(
            [layer_cls(config, i, rngs=rngs) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(
            h, eps=config.rms_norm_eps, unit_offset=config.is_gemma, param_dtype=config.dtype
        )


class LMHead(nnx.Module):
    """Untied LM head stored as HF stores it, vocab-major: ``weight [V, hidden]``.

    Vocab-major lets ``CausalLM.compute_logits(..., vocab_major=True)`` compute ``W @ h^T``:
    with V as the rows of the big operand XLA:CPU's GEMM needs no repacking of the 32000 x 512
    weight per call (tiny-llama, 64 rows: 9.5 vs 13.0 ms for ``h @ W``).
    """

    def __init__(self, hidden: int, vocab: int, *, param_dtype, rngs: nnx.Rngs):
        # The values ``linear(hidden, vocab)`` draws ([in, out] ~ N(0, 1/hidden)), transposed.
        kernel = normal_init(hidden**-0.5)(rngs.params(), (hidden, vocab), param_dtype)
        self.weight = nnx.Param(kernel.T)  # [V, hidden]


class CausalLM(nnx.Module):
    """Decoder-only LM with a functional paged-KV forward. Subclasses set ``layer_cls``."""

    layer_cls: type = None  # set by each family
    embed_scale: bool = False  # Gemma: multiply embeddings by sqrt(hidden_size)

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        # Random init: layer 0 sees embeddings of std 1/sqrt(hidden) after any input scaling.
        # (With Gemma's sqrt(hidden) scaling and tied embeddings a larger std makes each token's
        # own logit dominate, and the random model just repeats its input.)
        embed_std = config.hidden_size**-0.5 / (
            config.hidden_size**0.5 if self.embed_scale else 1.0
        )
        self.model = DecoderStack(config, self.layer_cls, embed_std=embed_std, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = LMHead(
                config.hidden_size, config.vocab_size, param_dtype=config.dtype, rngs=rngs
            )

    def embed(self, input_ids: jax.Array) -> jax.Array:  # [...] int32 -> [..., hidden]
        h = self.model.embed_tokens(input_ids)
        if self.embed_scale:  # HF rounds the normalizer to the activation dtype first
            h = h * jnp.asarray(self.config.hidden_size**0.5, dtype=h.dtype)
        return h

    # ---- paged forward -----------------------------------------------------------------------
    def __call__(
        self,
        input_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        kv_buffers: tuple[jax.Array, ...],  # per KV tensor: [N * page_bytes] uint8
        attn_metadata: tuple[AttentionMetadata, ...],  # per KV-cache group
        binding: KVCacheBinding,
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:  # hidden [T, hidden] (final-normed), buffers
        """One paged step: layer i writes/reads ``kv_buffers[tensor]`` with ``attn_metadata[group]``
        where ``(group, tensor) = binding.lookup(f"model.layers.{i}.self_attn")``.

        The buffers are carried through the layers as values (donate them in the jitted step).
        """
        buffers = list(kv_buffers)
        h = self.embed(input_ids)
        for i, layer in enumerate(self.model.layers):
            group, tensor = binding.lookup(layer_name(i))
            if group >= len(attn_metadata) or tensor >= len(buffers):
                raise ValueError(
                    f"{layer_name(i)} is bound to group {group}, tensor {tensor} but the "
                    f"step has {len(attn_metadata)} groups and {len(buffers)} buffers"
                )
            attend = functools.partial(
                layer.self_attn.paged_attend,
                buffer=buffers[tensor],
                md=attn_metadata[group],
                binding=binding,
            )
            h, buffers[tensor] = layer(h, positions, attend)
        return self.model.norm(h), tuple(buffers)

    def float_lm_head(self) -> jax.Array | None:
        """The LM head's float weights ``[V, hidden]`` (the tied embedding or ``lm_head``) when
        the logits are exactly ``hidden @ W^T`` summed in f32 (no quantized head, no final
        soft-cap), else None: what a greedy head may read in place of the logits
        (``jaxkv.worker.heads.LogitsHead.greedy_tokens``)."""
        if (
            isinstance(self.lm_head, QuantizedLMHead)
            or self.config.final_logit_softcapping is not None
        ):
            return None
        head = self.model.embed_tokens.embedding if self.lm_head is None else self.lm_head.weight
        return head[...]

    def compute_logits(
        self,
        hidden: jax.Array,  # [..., hidden] final-normed ([R, hidden] if vocab_major)
        *,
        vocab_major: bool = False,
    ) -> jax.Array:  # [..., V] f32, or [V, R] f32 when vocab_major
        """LM head (the tied embedding when ``tie_word_embeddings``; a quantized head,
        ``jaxkv.models.quant``, from its int8 / fp8 weights), then the final soft-cap.

        ``vocab_major=True`` returns the logits transposed, ``[V, R]`` (``W @ h^T``): the faster
        GEMM orientation on XLA:CPU for a decode step's few rows; the greedy sampler takes its
        argmax over axis 0.
        """
        if vocab_major and hidden.ndim != 2:
            raise ValueError(f"vocab_major logits need hidden [R, hidden], got {hidden.shape}")
        if isinstance(self.lm_head, QuantizedLMHead):  # inside the program, from int8 / fp8
            logits = self.lm_head.logits(hidden, vocab_major=vocab_major)
        else:
            w = (
                self.model.embed_tokens.embedding if self.lm_head is None else self.lm_head.weight
            )[...]
            hidden = hidden.astype(w.dtype)

            def on_xla(h, w):  # summed in f32 and not rounded to w's dtype first
                if vocab_major:
                    return jnp.einsum("vh,rh->vr", w, h, preferred_element_type=jnp.float32)
                return jnp.einsum("...h,vh->...v", h, w, preferred_element_type=jnp.float32)

            if jnp.dtype(w.dtype) in CPU_KERNEL_FLOAT_DTYPES and hidden.size:
                # a bf16 head: on the CPU AMX tiles, the C++ kernel or XLA's bf16 dot (float_matmul)
                logits = float_matmul(
                    hidden, w, jnp.float32, out_major=True, transposed=vocab_major, default=on_xla
                )
            else:
                logits = on_xla(hidden, w)
        logits = logits.astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits

    def kv_layer_infos(self) -> dict[str, LayerKVInfo]:
        """Per attention layer: KV heads, head size, sliding window (the engine builds specs)."""
        c = self.config
        return {
            layer_name(i): LayerKVInfo(c.num_key_value_heads, c.head_dim, c.layer_window(i))
            for i in range(c.num_hidden_layers)
        }
