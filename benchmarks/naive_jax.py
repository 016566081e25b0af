"""The naive JAX baseline: what a competent JAX user writes for a Llama without jaxkv.

Same model, same weights (read out of the jaxkv NNX model, never re-initialised), a dense
KV cache ``[num_layers] x [batch, max_len, num_kv_heads, head_dim]`` (one array per layer,
DESIGN.md 6), static batches:

  * requests are taken in order, ``batch_size`` (= the engine's max_num_seqs) at a time;
  * prompts are LEFT-padded to the longest prompt of the batch, so every row writes the same
    cache column each decode step (one ``dynamic_update_slice``); RoPE positions are
    ``column - pad`` and keys left of ``pad`` are masked;
  * prefill runs the padded batch in row chunks of about ``prefill_tokens`` tokens (a dense
    ``[rows, heads, P, P]`` logit tensor for 64 rows of 1k tokens would not fit), writing the
    cache in place (donated); logits only for the last position;
  * decode is one jitted ``lax.fori_loop`` over ``max_output - 1`` steps with the caches
    donated (no host round trip per token), run to the longest output of the batch.

einsum orders keep batch dims first and the contraction output as ``[b, kv_head, group, ...]``
then transpose (DESIGN.md 6). Every shape is compiled ahead of timing (``compile_seconds``).
Only useful output tokens (each request's own ``max_tokens``) count towards throughput.
Llama family only (Llama/Mistral/Qwen2/Qwen3: q/k/v bias, q/k norm, sliding window).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# ---- parameters out of the jaxkv model --------------------------------------------------------


def extract_params(model) -> dict:
    """Plain pytree of the NNX model's arrays (no copy, except lm_head): embed [V, H],
    final_norm [H], lm_head [H, V] | None (tied; a transposed copy of jaxkv's vocab-major
    weight, as a Dense kernel a user would write), layers: list of dicts of per-layer arrays."""
    cfg = model.config
    if cfg.architecture != "llama":
        raise ValueError(
            f"the naive baseline covers the llama family only, got {cfg.architecture!r}"
        )

    def val(p):
        return None if p is None else p[...]

    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append(
            {
                "ln1": val(layer.input_layernorm.weight),
                "ln2": val(layer.post_attention_layernorm.weight),
                "wq": val(a.q_proj.kernel),
                "wk": val(a.k_proj.kernel),
                "wv": val(a.v_proj.kernel),
                "wo": val(a.o_proj.kernel),
                "bq": val(a.q_proj.bias),
                "bk": val(a.k_proj.bias),
                "bv": val(a.v_proj.bias),
                "bo": val(a.o_proj.bias),
                "qn": val(a.q_norm.weight) if a.q_norm is not None else None,
                "kn": val(a.k_norm.weight) if a.k_norm is not None else None,
                "wg": val(m.gate_proj.kernel),
                "wu": val(m.up_proj.kernel),
                "wd": val(m.down_proj.kernel),
            }
        )
    return {
        "embed": val(model.model.embed_tokens.embedding),
        "final_norm": val(model.model.norm.weight),
        "lm_head": None if model.lm_head is None else val(model.lm_head.weight).T,
        "layers": layers,
    }


@dataclasses.dataclass(frozen=True)
class Dims:
    """The static facts the forward needs (hashable: a jit static argument)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    sm_scale: float
    inv_freq: tuple[float, ...]
    sliding_window: tuple[int | None, ...]  # per layer
    act: str

    @classmethod
    def from_model(cls, model) -> Dims:
        c = model.config
        a0 = model.model.layers[0].self_attn
        return cls(
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            float(c.rms_norm_eps),
            float(c.sm_scale),
            tuple(a0.inv_freq),
            tuple(c.layer_window(i) for i in range(c.num_hidden_layers)),
            c.hidden_act,
        )


# ---- the forward ------------------------------------------------------------------------------


def _rms(x, w, eps):  # [..., H] -> [..., H] (HF numerics: f32 normalise)
    x32 = x.astype(jnp.float32)
    n = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * n.astype(x.dtype)


def _rope(x, pos, inv_freq):  # x [..., H, D], pos [...] -> rotate_half RoPE
    f = pos.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., D/2]
    emb = jnp.concatenate([f, f], axis=-1)[..., None, :]  # [..., 1, D]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _lin(x, w, b):
    y = x @ w
    return y if b is None else y + b


def _qkv(p, h, pos, d: Dims):  # h [..., H], pos [...] -> q [..., Hq, D], k/v [..., Hkv, D]
    lead = h.shape[:-1]
    q = _lin(h, p["wq"], p["bq"]).reshape(*lead, d.num_heads, d.head_dim)
    k = _lin(h, p["wk"], p["bk"]).reshape(*lead, d.num_kv_heads, d.head_dim)
    v = _lin(h, p["wv"], p["bv"]).reshape(*lead, d.num_kv_heads, d.head_dim)
    if p["qn"] is not None:
        q, k = _rms(q, p["qn"], d.eps), _rms(k, p["kn"], d.eps)
    return _rope(q, pos, d.inv_freq), _rope(k, pos, d.inv_freq), v


def _mlp(p, x, d: Dims):
    act = jax.nn.silu if d.act == "silu" else functools.partial(jax.nn.gelu, approximate=True)
    return (act(x @ p["wg"]) * (x @ p["wu"])) @ p["wd"]


def _softmax_attend(logits, mask, v, einsum_pv):  # masked f32 softmax (finite fill: no NaN rows)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum(einsum_pv, probs.astype(v.dtype), v)


def _logits(params, h):  # [R, H] final-normed -> [R, V] f32
    w = params["lm_head"]
    out = h @ w if w is not None else jnp.einsum("rh,vh->rv", h, params["embed"])
    return out.astype(jnp.float32)


def prefill(params, caches, ids, pad, row0, *, d: Dims):
    """Rows ``row0 .. row0+R`` of the batch: writes cache columns [0, P); returns greedy tokens.

    ids [R, P] int32 (left-padded), pad [R] int32; caches: tuple of (k, v) [B, L, Hkv, D].
    """
    r, plen = ids.shape
    col = jnp.arange(plen, dtype=jnp.int32)
    pos = jnp.maximum(col[None, :] - pad[:, None], 0)  # [R, P]
    x = params["embed"][ids]  # [R, P, H]
    g = d.num_heads // d.num_kv_heads
    new = []
    for i, p in enumerate(params["layers"]):
        q, k, v = _qkv(p, _rms(x, p["ln1"], d.eps), pos, d)
        kc, vc = caches[i]
        kc = lax.dynamic_update_slice(kc, k.astype(kc.dtype), (row0, 0, 0, 0))
        vc = lax.dynamic_update_slice(vc, v.astype(vc.dtype), (row0, 0, 0, 0))
        new.append((kc, vc))
        qg = q.reshape(r, plen, d.num_kv_heads, g, d.head_dim)
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k) * d.sm_scale  # [R, Hkv, G, P, P]
        mask = (col[None, :] <= col[:, None])[None] & (col[None, None, :] >= pad[:, None, None])
        if d.sliding_window[i] is not None:
            mask &= (col[None, :] > col[:, None] - d.sliding_window[i])[None]
        o = _softmax_attend(s.astype(jnp.float32), mask[:, None, None], v, "bkgqs,bskd->bkgqd")
        o = o.transpose(0, 3, 1, 2, 4).reshape(r, plen, d.num_heads * d.head_dim)
        x = x + _lin(o, p["wo"], p["bo"])
        x = x + _mlp(p, _rms(x, p["ln2"], d.eps), d)
    h = _rms(x[:, -1], params["final_norm"], d.eps)  # [R, H]
    return tuple(new), jnp.argmax(_logits(params, h), axis=-1).astype(jnp.int32)


def decode_step(params, caches, tok, pad, t, *, d: Dims):
    """One token per row at cache column ``t`` (same for every row). tok [B], pad [B] -> next [B]."""
    b = tok.shape[0]
    length = caches[0][0].shape[1]
    col = jnp.arange(length, dtype=jnp.int32)
    pos = t - pad  # [B]
    x = params["embed"][tok]  # [B, H]
    g = d.num_heads // d.num_kv_heads
    new = []
    for i, p in enumerate(params["layers"]):
        q, k, v = _qkv(p, _rms(x, p["ln1"], d.eps), pos, d)  # q [B, Hq, D]
        kc, vc = caches[i]
        kc = lax.dynamic_update_slice(kc, k[:, None].astype(kc.dtype), (0, t, 0, 0))
        vc = lax.dynamic_update_slice(vc, v[:, None].astype(vc.dtype), (0, t, 0, 0))
        new.append((kc, vc))
        qg = q.reshape(b, d.num_kv_heads, g, d.head_dim)
        s = jnp.einsum("bkgd,bskd->bkgs", qg, kc) * d.sm_scale  # [B, Hkv, G, L]
        mask = (col[None, :] >= pad[:, None]) & (col[None, :] <= t)  # [B, L]
        if d.sliding_window[i] is not None:
            mask &= col[None, :] > t - d.sliding_window[i]
        o = _softmax_attend(s.astype(jnp.float32), mask[:, None, None], vc, "bkgs,bskd->bkgd")
        x = x + _lin(o.reshape(b, d.num_heads * d.head_dim), p["wo"], p["bo"])
        x = x + _mlp(p, _rms(x, p["ln2"], d.eps), d)
    h = _rms(x, params["final_norm"], d.eps)
    return tuple(new), jnp.argmax(_logits(params, h), axis=-1).astype(jnp.int32)


def decode_loop(params, caches, tok, pad, t0, num_steps, *, d: Dims, max_steps: int):
    """``num_steps`` greedy steps from column ``t0``; tokens [B, max_steps] (unused columns 0)."""
    out = jnp.zeros((tok.shape[0], max_steps), jnp.int32)

    def body(i, carry):
        caches, tok, out = carry
        caches, tok = decode_step(params, caches, tok, pad, t0 + i, d=d)
        return caches, tok, lax.dynamic_update_slice(out, tok[:, None], (0, i))

    caches, _, out = lax.fori_loop(0, num_steps, body, (caches, tok, out))
    return caches, out


# ---- static-batch generation ------------------------------------------------------------------


class NaiveJaxLlama:
    """Static-batch greedy generation over a dense cache, compiled ahead per shape."""

    def __init__(
        self, model, *, batch_size: int = 64, prefill_tokens: int = 8192, cache_dtype=None
    ):
        self.params = extract_params(model)
        self.dims = Dims.from_model(model)
        self.batch_size = batch_size
        self.prefill_tokens = prefill_tokens
        self.dtype = jnp.dtype(cache_dtype or model.config.dtype)
        self._prefill = jax.jit(
            functools.partial(prefill, d=self.dims), donate_argnames=("caches",)
        )
        self._compiled: dict = {}
        self.compile_seconds = 0.0
        self.num_compiles = 0

    # shapes -----------------------------------------------------------------------------------
    def _rows(self, b: int, plen: int) -> int:
        """Prefill rows per chunk: the largest power of two <= prefill_tokens / P, at most b."""
        r = 1
        while r * 2 <= max(1, self.prefill_tokens // plen) and r * 2 <= b:
            r *= 2
        return r

    def _cache_struct(self, b, length):
        d = self.dims
        leaf = jax.ShapeDtypeStruct((b, length, d.num_kv_heads, d.head_dim), self.dtype)
        return tuple((leaf, leaf) for _ in range(d.num_layers))

    def _get(self, kind, *key):
        """AOT-compiled executable for ``(kind, shape...)`` (compile time counted separately)."""
        if (kind, *key) in self._compiled:
            return self._compiled[(kind, *key)]
        t0 = time.perf_counter()
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        if kind == "prefill":
            b, length, r, plen = key
            exe = self._prefill.lower(
                self.params, self._cache_struct(b, length), i32(r, plen), i32(r), i32()
            ).compile()
        else:
            b, length, max_steps = key
            fn = jax.jit(
                functools.partial(decode_loop, d=self.dims, max_steps=max_steps),
                donate_argnames=("caches",),
            )
            exe = fn.lower(
                self.params, self._cache_struct(b, length), i32(b), i32(b), i32(), i32()
            ).compile()
        self.compile_seconds += time.perf_counter() - t0
        self.num_compiles += 1
        self._compiled[(kind, *key)] = exe
        return exe

    def batches(self, prompts, max_tokens):
        """(start, end, P, max_out) of each static batch, requests in order."""
        out = []
        for s in range(0, len(prompts), self.batch_size):
            e = min(s + self.batch_size, len(prompts))
            out.append((s, e, max(len(p) for p in prompts[s:e]), max(max_tokens[s:e])))
        return out

    def compile_for(self, prompts, max_tokens) -> None:
        for s, e, plen, mo in self.batches(prompts, max_tokens):
            b, length = e - s, plen + mo
            self._get("prefill", b, length, self._rows(b, plen), plen)
            if mo > 1:
                self._get("decode", b, length, mo - 1)

    # running ----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        """Greedy, EOS ignored. Returns tokens per request (own max_tokens only) and timings.

        ``ttft_s[i]`` = time from the call until request i's batch finished its prefill (all
        requests arrive at once, as in the engine run); ``tpot_s[i]`` = its batch's decode time
        per step; ``finish_s[i]`` = when its batch ended (the loop runs to the batch's longest).
        """
        self.compile_for(prompts, max_tokens)
        n = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(n)]
        ttft, tpot, finish = [0.0] * n, [None] * n, [0.0] * n
        padded_tokens = 0
        t_start = time.perf_counter()
        for s, e, plen, mo in self.batches(prompts, max_tokens):
            b, length = e - s, plen + mo
            ids = np.zeros((b, plen), np.int32)
            pad = np.zeros(b, np.int32)
            for j, p in enumerate(prompts[s:e]):
                pad[j] = plen - len(p)
                ids[j, pad[j] :] = p
            caches = tuple(
                (
                    jnp.zeros((b, length, self.dims.num_kv_heads, self.dims.head_dim), self.dtype),
                    jnp.zeros((b, length, self.dims.num_kv_heads, self.dims.head_dim), self.dtype),
                )
                for _ in range(self.dims.num_layers)
            )
            r = self._rows(b, plen)
            exe = self._get("prefill", b, length, r, plen)
            first = np.zeros(b, np.int32)
            starts = list(range(0, b - r + 1, r))
            if starts[-1] + r < b:
                starts.append(b - r)  # overlapping last chunk: recomputes identical rows
            for row0 in starts:
                caches, tok = exe(
                    self.params,
                    caches,
                    jnp.asarray(ids[row0 : row0 + r]),
                    jnp.asarray(pad[row0 : row0 + r]),
                    jnp.int32(row0),
                )
                first[row0 : row0 + r] = np.asarray(tok)
            t_first = time.perf_counter()
            out = np.zeros((b, 0), np.int32)
            if mo > 1:
                dec = self._get("decode", b, length, mo - 1)
                caches, out = dec(
                    self.params,
                    caches,
                    jnp.asarray(first),
                    jnp.asarray(pad),
                    jnp.int32(plen),
                    jnp.int32(mo - 1),
                )
                out = np.asarray(out)
            t_end = time.perf_counter()
            del caches
            padded_tokens += b * (plen + mo)
            for j in range(b):
                i = s + j
                tokens[i] = ([int(first[j])] + out[j].tolist())[: max_tokens[i]]
                ttft[i] = t_first - t_start
                tpot[i] = (t_end - t_first) / (mo - 1) if mo > 1 else None
                finish[i] = t_end - t_start
        elapsed = time.perf_counter() - t_start
        return {
            "tokens": tokens,
            "elapsed_s": elapsed,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "finish_s": finish,
            "padded_token_slots": padded_tokens,
        }

    def decode_step_time(self, batch: int, context: int, steps: int = 8) -> float:
        """Seconds per decode step at ``context`` columns (a cache of exactly ``context``;
        the dense step's work does not depend on the cache contents, so zeros are fine)."""
        exe = self._get("decode", batch, context, steps)
        caches = tuple(
            (jnp.zeros((batch, context, self.dims.num_kv_heads, self.dims.head_dim), self.dtype),)
            * 2
            for _ in range(self.dims.num_layers)
        )
        caches = tuple((jnp.array(k), jnp.array(v)) for k, v in caches)  # distinct donated buffers
        tok = jnp.zeros(batch, jnp.int32)
        pad = jnp.zeros(batch, jnp.int32)
        caches, out = exe(self.params, caches, tok, pad, jnp.int32(context - steps), jnp.int32(1))
        jax.block_until_ready(out)  # warm (1 step)
        t0 = time.perf_counter()
        caches, out = exe(
            self.params, caches, tok, pad, jnp.int32(context - steps), jnp.int32(steps)
        )
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / steps
