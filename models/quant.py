"""Weight-only quantization: linear kernels and the LM head kept as int8 or fp8 in device memory.

A quantized kernel is ``q`` (int8, or float8_e4m3fn for "fp8") plus float32 scales, symmetric
(no zero point), with ``w ~= q * scale``:

* per output channel: ``scale [out]``, one per column of a ``[in, out]`` kernel
  (``amax over the inputs / qmax``);
* per block of ``block`` inputs: ``scale [in // block, out]`` (GGUF Q8_0's layout with
  block 32: a Q8_0 tensor's blocks load as they are stored, bit for bit).

``QuantizedLinear.__call__`` (``quantized_matmul``) computes inside the jitted forward: per
output channel ``(x @ q) * scale`` (the dot takes ``q`` converted to the compute dtype, which
XLA:GPU fuses into its GEMM: the weights stream from HBM at their own width), per block
``x @ (q * scale)`` (the kernel dequantized in temp first). No float copy of the weights is
stored.

Modes (``load_model(..., quantization=...)``, ``EngineConfig.quantization``):

* ``"int8"``: int8, per output channel; a GGUF checkpoint (and SmolLM2, converted from
  one) gets blocks of 32 inputs instead, so its Q8_0 tensors are kept as stored and its other
  tensors (F16/F32, Q4, K-quants) are dequantized then re-quantized to int8 blocks of 32.
* ``"fp8"``: float8_e4m3fn per output channel (``amax / 448``), any checkpoint.

What is quantized: every ``nnx.Linear`` of the model (q/k/v/o, gate/up/down) and the LM
head; a head tied to the embedding gets a quantized copy of its own while the embedding
lookup stays float. Norms, biases and the embedding stay in the model's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

#: ``quantization`` values (None: float weights).
QUANTIZATION_MODES = ("int8", "fp8")

#: inputs per block of GGUF's Q8_0 (and of the "int8" layout of GGUF checkpoints)
GGUF_BLOCK = 32

_QMAX = {"int8": 127.0, "fp8": 448.0}  # float8_e4m3fn's largest finite value is 448
_QDTYPE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def check_quantization(value) -> str | None:
    """``value`` if it is None or one of ``QUANTIZATION_MODES``; else ValueError naming it."""
    if value is not None and (not isinstance(value, str) or value not in QUANTIZATION_MODES):
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES} or None, got {value!r}")
    return value


def _quantize(w, block: int | None, mode: str):
    """``w [in, out]`` -> ``(q [in, out], scale [out] | [in // block, out] float32)``.

    numpy in, numpy out (host-side loading); jax in, jax out (inside a jitted init)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    if w.ndim != 2:
        raise ValueError(f"quantization takes a [in, out] kernel, got shape {w.shape}")
    n_in, n_out = w.shape
    w32 = w.astype(np.float32)
    if block is None:
        groups = w32[None]  # [1, in, out]
    else:
        if n_in % block:
            raise ValueError(f"block {block} does not divide the {n_in} inputs of {w.shape}")
        groups = w32.reshape(n_in // block, block, n_out)  # [in / block, block, out]
    # times the float32 reciprocal, not "/ qmax": XLA rewrites a division by a constant so,
    # and a host load (numpy) must give the device init's (jax) scales bit for bit
    scale = xp.max(xp.abs(groups), axis=1) * np.float32(1.0 / _QMAX[mode])  # [G, out]
    safe = xp.where(scale == 0, np.float32(1), scale)[:, None, :]
    scaled = xp.clip(groups / safe, -_QMAX[mode], _QMAX[mode])
    if mode == "int8":
        scaled = xp.round(scaled)
    q = scaled.astype(_QDTYPE[mode]).reshape(n_in, n_out)
    scale = scale.astype(np.float32)
    return q, (scale[0] if block is None else scale)


def quantize_int8(w, block: int | None = None):
    """Symmetric int8 of a kernel ``w [in, out]`` (numpy or jax, any float dtype).

    Returns ``(q [in, out] int8, scale float32)``: ``scale [out]`` per output channel
    (``block=None``), or ``[in // block, out]`` per block of ``block`` inputs
    (``block=32``: GGUF Q8_0's grouping). ``q = round(w / scale)`` in [-127, 127], ``scale =
    amax / 127`` (an all-zero group has scale 0 and q 0). Error: ``|w - dequantize(q, scale)|
    <= scale / 2`` element-wise (plus float32 rounding).
    """
    return _quantize(w, block, "int8")


def quantize_fp8(w, block: int | None = None):
    """float8_e4m3fn of a kernel ``w [in, out]``: ``scale = amax / 448`` per output channel
    (``[out]``) or per block (``[in // block, out]``), ``q = fp8(w / scale)`` (round to
    nearest, 3 mantissa bits: relative error <= 2**-4 for normal values)."""
    return _quantize(w, block, "fp8")


def quantize(w, mode: str, block: int | None = None):
    """``quantize_int8`` or ``quantize_fp8`` by ``mode`` ("int8" / "fp8")."""
    return _quantize(w, block, check_quantization(mode))


def dequantize(q, scale, dtype=jnp.float32):
    """``q [in, out]`` times its scales (``[out]`` or ``[in // block, out]``; the block size
    is ``in // scale.shape[0]``) in ``dtype``: the float kernel ``[in, out]``.

    numpy in, numpy out; jax in (inside jit), jax out."""
    xp = np if isinstance(q, np.ndarray) and isinstance(scale, np.ndarray) else jnp
    dtype = np.dtype(dtype)
    if scale.ndim == 1:
        return q.astype(dtype) * scale.astype(dtype)[None, :]
    n_in, n_out = q.shape
    groups = scale.shape[0]
    w = q.reshape(groups, n_in // groups, n_out).astype(dtype) * scale.astype(dtype)[:, None, :]
    return xp.reshape(w, (n_in, n_out))


#: Most rows (tokens) a quantized matmul sends to the C++ kernel on the CPU; more go to XLA.
CPU_KERNEL_MAX_ROWS = 32


def quantized_matmul(x, q, scale, dtype, *, out_major: bool = False, out_dtype=None) -> jax.Array:
    """``x [..., in] @ dequantize(q [in, out], scale)`` in ``dtype`` (jax, inside jit); with
    ``out_major``, ``q [out, in]`` and ``scale [out] | [out, in // block]`` (the LM head's
    vocabulary-major layout). The result is ``[..., out]`` in ``out_dtype`` (default ``dtype``).

    On XLA (GPU, TPU, and the CPU above ``CPU_KERNEL_MAX_ROWS`` rows): per output channel
    (``scale [out]``) the dot takes the converted ``q`` and the scales multiply its f32 result;
    XLA:GPU then fuses the int8 / fp8 -> ``dtype`` convert into its GEMM (the kernel is read
    from HBM as stored, no dequantized copy in temp: tests/gpu_aot/test_h200_quantized.py),
    and so does the TPU compiler. Per block of inputs the kernel is dequantized first
    (``dequantize``): XLA:GPU fuses no per-block scale into a dot.

    On the CPU, up to ``CPU_KERNEL_MAX_ROWS`` rows (decode steps) run the C++ kernel
    (``jaxkv.pallas_kernels.cpu_backend.quantized_matmul``), which reads each weight byte once:
    XLA:CPU converts the whole kernel to float before its dot. Chosen per platform when the
    program is lowered (``jax.lax.platform_dependent``), so a GPU or TPU compile never sees it.
    """
    out_dtype = dtype if out_dtype is None else out_dtype
    lead = x.shape[:-1]
    rows = int(np.prod(lead))
    n_out = q.shape[0] if out_major else q.shape[1]

    def on_xla(x, q, scale):
        contract = (((x.ndim - 1,), (1 if out_major else 0,)), ((), ()))
        if scale.ndim == 1:
            y = jax.lax.dot_general(
                x.astype(dtype), q.astype(dtype), contract, preferred_element_type=jnp.float32
            )  # [..., out] f32
            return (y * scale).astype(out_dtype)
        if out_major:
            w = dequantize(q.T, scale.T, dtype)  # [in, out]
            contract = (((x.ndim - 1,), (0,)), ((), ()))
        else:
            w = dequantize(q, scale, dtype)  # [in, out]
        return jax.lax.dot_general(x.astype(dtype), w, contract).astype(out_dtype)

    from jaxkv.pallas_kernels import cpu_backend  # builds its C++ only when asked

    if 0 < rows <= CPU_KERNEL_MAX_ROWS and cpu_backend.use_cpu_kernels():

        def on_cpu(x, q, scale):
            y = cpu_backend.quantized_matmul(
                x.reshape(rows, x.shape[-1]), q, scale, out_major=out_major
            )
            return y.reshape(*lead, n_out).astype(out_dtype)

        return jax.lax.platform_dependent(x, q, scale, cpu=on_cpu, default=on_xla)
    return on_xla(x, q, scale)


class QuantizedLinear(nnx.Module):
    """``y = x @ dequantize(kernel, scale) + bias``; weight-only quantized ``nnx.Linear``.

    Parameters (all ``nnx.Param``): ``kernel [in, out]`` int8 / float8_e4m3fn; per output
    channel ``scale [out]`` float32, or per block ``block_scale [in // block, out]`` float32;
    ``bias [out]`` in ``dtype`` (or None). ``dtype`` is the compute dtype: the activations
    and the dequantized kernel are cast to it.
    """

    def __init__(self, kernel, scale, bias=None, *, mode: str, dtype=jnp.float32):
        check_quantization(mode)
        n_in, n_out = kernel.shape
        if scale.shape not in ((n_out,),) and (
            len(scale.shape) != 2 or scale.shape[1] != n_out or n_in % scale.shape[0]
        ):
            raise ValueError(f"scale {scale.shape} does not fit kernel {kernel.shape}")
        self.in_features, self.out_features = int(n_in), int(n_out)
        self.mode = mode
        self.block = None if len(scale.shape) == 1 else n_in // scale.shape[0]
        self.dtype = np.dtype(dtype).name
        self.kernel = nnx.Param(kernel)  # [in, out] int8 | float8_e4m3fn
        if self.block is None:
            self.scale = nnx.Param(scale)  # [out] float32
        else:
            self.block_scale = nnx.Param(scale)  # [in // block, out] float32
        self.bias = None if bias is None else nnx.Param(bias)  # [out]

    @classmethod
    def from_linear(cls, linear: nnx.Linear, mode: str, block: int | None = None):
        """``linear``'s kernel quantized (``block`` when it divides the inputs, else per output
        channel); its bias and compute dtype kept."""
        w = linear.kernel[...]  # [in, out]
        block = block if block is not None and w.shape[0] % block == 0 else None
        q, scale = quantize(w, mode, block)
        bias = None if linear.bias is None else linear.bias[...]
        dtype = linear.dtype if linear.dtype is not None else w.dtype
        return cls(q, scale, bias, mode=mode, dtype=dtype)

    def scales(self) -> jax.Array:  # [out] | [in // block, out] float32
        return (self.scale if self.block is None else self.block_scale)[...]

    def dequantized(self) -> jax.Array:  # [in, out] dtype
        return dequantize(self.kernel[...], self.scales(), self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out] dtype
        y = quantized_matmul(x, self.kernel[...], self.scales(), self.dtype)  # [..., out]
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class QuantizedLMHead(nnx.Module):
    """The LM head, vocab-major as ``LMHead``: ``weight [V, hidden]`` int8 / float8_e4m3fn,
    ``scale [V]`` (per vocabulary row) or ``block_scale [V, hidden // block]`` float32.

    Built from an untied head's weight or, when tied, from the embedding (a quantized copy:
    the embedding lookup keeps the float table)."""

    def __init__(self, weight, scale, *, mode: str, dtype=jnp.float32):
        check_quantization(mode)
        self.mode = mode
        self.dtype = np.dtype(dtype).name
        self.block = None if len(scale.shape) == 1 else weight.shape[1] // scale.shape[1]
        self.weight = nnx.Param(weight)  # [V, hidden]
        if self.block is None:
            self.scale = nnx.Param(scale)  # [V]
        else:
            self.block_scale = nnx.Param(scale)  # [V, hidden // block]

    @classmethod
    def from_weight(cls, weight, mode: str, block: int | None = None, dtype=None):
        """``weight [V, hidden]`` quantized along hidden (per row, or per block of
        ``block`` when it divides hidden)."""
        block = block if block is not None and weight.shape[1] % block == 0 else None
        q, scale = quantize(weight.T, mode, block)  # [hidden, V], [V] | [hidden // b, V]
        dtype = weight.dtype if dtype is None else dtype
        return cls(q.T, scale.T, mode=mode, dtype=dtype)

    def scales(self) -> jax.Array:  # [V] | [V, hidden // block] float32
        return (self.scale if self.block is None else self.block_scale)[...]

    def dequantized(self) -> jax.Array:  # [V, hidden] dtype
        return dequantize(self.weight[...].T, self.scales().T, self.dtype).T

    def logits(self, hidden: jax.Array, *, vocab_major: bool = False) -> jax.Array:
        """``hidden [..., hidden]`` -> ``[..., V]`` f32 (``[V, R]`` when ``vocab_major``,
        ``hidden [R, hidden]``), through ``quantized_matmul`` on the vocabulary-major weight."""
        logits = quantized_matmul(
            hidden,
            self.weight[...],
            self.scales(),
            self.dtype,
            out_major=True,
            out_dtype=jnp.float32,
        )  # [..., V] f32
        return logits.T if vocab_major else logits


def quantized_modules(model) -> dict[tuple, nnx.Module]:
    """nnx path -> module of every ``QuantizedLinear`` / ``QuantizedLMHead`` of ``model``."""
    return {
        tuple(path): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, (QuantizedLinear, QuantizedLMHead))
    }


def _get_child(parent, key):
    return parent[int(key)] if isinstance(parent, (nnx.List, list)) else getattr(parent, str(key))


def _set_child(parent, key, value) -> None:
    if isinstance(parent, (nnx.List, list)):
        parent[int(key)] = value
    else:
        setattr(parent, str(key), value)


def quantize_model(model, mode: str | None, block: int | None = None, *, blocks=None):
    """Replaces, in place, every ``nnx.Linear`` of ``model`` by a ``QuantizedLinear`` of its
    kernel, and its LM head (``model.lm_head``, or the tied embedding) by a
    ``QuantizedLMHead``; returns ``model``. ``mode`` None returns it unchanged.

    ``block``: per block of that many inputs where it divides a layer's inputs, else per
    output channel. ``blocks``: HF weight name (``"model.layers.0.mlp.up_proj.weight"``,
    ``"lm_head.weight"``) -> the block of that layer, over ``block`` (a checkpoint's own
    layout; a tied head takes ``block``). Works inside ``nnx.eval_shape`` and ``jax.jit`` (what
    ``build_model`` does); on a concrete model it quantizes on the model's devices.
    """
    if check_quantization(mode) is None:
        return model
    blocks = {} if blocks is None else blocks
    linears = [
        path for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear) and path
    ]
    for path in linears:
        parent = model
        for key in path[:-1]:
            parent = _get_child(parent, key)
        child = _get_child(parent, path[-1])
        layer_block = blocks.get(".".join(str(p) for p in path) + ".weight", block)
        _set_child(parent, path[-1], QuantizedLinear.from_linear(child, mode, layer_block))
    if hasattr(model, "lm_head") and not isinstance(model.lm_head, QuantizedLMHead):
        if model.lm_head is None:
            weight, head_block = model.model.embed_tokens.embedding[...], block  # [V, hidden]
        else:
            weight = model.lm_head.weight[...]  # [V, hidden]
            head_block = blocks.get("lm_head.weight", block)
        model.lm_head = nnx.data(QuantizedLMHead.from_weight(weight, mode, head_block))
    return model
