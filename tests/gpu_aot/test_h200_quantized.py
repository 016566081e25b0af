"""Weight-only int8 / fp8 / q4 weights on the deviceless H200: the weights stay quantized in HBM.

A Llama-3-8B-sized layer (hidden 4096, MLP 14336, 32 / 8 heads of 128, vocabulary 128256) with
``quantization="int8"`` / ``"fp8"`` (per output channel), weights abstract: its linear kernels
and LM head are held at one byte per parameter, and the compiled decode forward (which
includes the greedy LM head) converts them inside XLA's GEMM fusions: no dequantized copy of
any kernel is made in temp (the largest, the MLP's 4096 x 14336, would be 112 MiB in bf16;
the whole program's temp stays below that and no fusion outside a GEMM writes a kernel-sized
bf16 array). ``jaxkv.models.quant.quantized_matmul`` says why the form matters.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx

from jaxkv.models import build_model, get_config
from jaxkv.models.quant import quantized_modules
from tests.engine.helpers import LLAMA3_8B_LAYER, llama3_8b_layer, llama3_8b_layer_runner
from tests.gpu_aot.helpers import compile_forward

pytestmark = pytest.mark.gpu_aot

MLP_KERNEL_BF16 = 4096 * 14336 * 2  # 112 MiB: one dequantized MLP kernel


def _kernel_sized_bf16_outside_gemms(hlo: str) -> list[str]:
    """Instructions of the entry computation that write a bf16 array as large as a linear
    kernel (a materialised dequantized weight): not a parameter, a bitcast (no data written),
    a GEMM fusion or a custom call."""
    entry = hlo[hlo.index("ENTRY") :]
    found = []
    for line in entry.splitlines():
        m = re.search(r"= bf16\[([\d,]+)\]", line)
        if not m or any(w in line for w in ("gemm", "custom-call", "parameter(", " bitcast(")):
            continue
        if np.prod([int(d) for d in m.group(1).split(",")]) >= 4096 * 4096:
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_llama3_8b_layer_keeps_quantized_weights_on_h200(h200, mode):
    model = llama3_8b_layer(mode)
    qmods = quantized_modules(model)
    assert len(qmods) == 8  # q, k, v, o, gate, up, down and the (tied) head
    n_params = sum(
        int(np.prod(m.kernel.shape if hasattr(m, "kernel") else m.weight.shape))
        for m in qmods.values()
    )
    q_bytes = sum(
        leaf.size * leaf.dtype.itemsize
        for m in qmods.values()
        for leaf in jax.tree.leaves(nnx.state(m, nnx.Param))
    )
    assert n_params <= q_bytes < 1.01 * n_params  # one byte a parameter, plus f32 scales
    compiled = compile_forward(llama3_8b_layer_runner(model), h200, 64)  # decode: + the greedy head
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(
        f"{mode}: weights {q_bytes / 2**20:.0f} MiB for {n_params / 1e6:.0f} M params; "
        f"decode forward temp {temp / 2**20:.1f} MiB"
    )
    # below one dequantized MLP kernel (the old form needed 127.8 MiB; this one 31.4 MiB with
    # jax 0.10.2 and 62.8 MiB with jax 0.12, whose GEMMs split K into f32 partial sums)
    assert temp < MLP_KERNEL_BF16, temp
    assert _kernel_sized_bf16_outside_gemms(compiled.as_text()) == []


@pytest.mark.parametrize("mode, block", [("q4", 32), ("int8", 32)])
def test_llama3_8b_layer_block_weights_stay_in_blocks_on_h200(h200, mode, block):
    """Per-block kernels ("q4": half a byte a parameter plus a float16 scale and offset per 32,
    5/8 of a byte in all; int8 in GGUF Q8_0's blocks of 32: 1 byte plus a float32 scale per
    32) go through the Pallas block-dequantizing matmul (``block_dequant_matmul``): no
    dequantized kernel in temp (through XLA: 1033.8 MiB for q4, 1033.3 MiB for int8 blocks,
    with the head's 128256 x 4096 bf16 copy; this kernel: 70.5 MiB) and no kernel-sized bf16
    array outside a GEMM or a kernel."""
    cfg = get_config("tiny-llama", **LLAMA3_8B_LAYER)
    model = nnx.eval_shape(
        lambda: build_model(cfg, seed=0, quantization=mode, quantization_block=block)
    )
    qmods = quantized_modules(model)
    assert len(qmods) == 8 and {(m.mode, m.block) for m in qmods.values()} == {(mode, block)}
    n_params = sum(
        m.in_features * m.out_features if hasattr(m, "kernel") else cfg.vocab_size * cfg.hidden_size
        for m in qmods.values()
    )
    q_bytes = sum(
        leaf.size * leaf.dtype.itemsize
        for m in qmods.values()
        for leaf in jax.tree.leaves(nnx.state(m, nnx.Param))
    )
    per_param = 0.5 + 4 / 32 if mode == "q4" else 1 + 4 / 32
    assert q_bytes == n_params * per_param
    compiled = compile_forward(llama3_8b_layer_runner(model), h200, 64)
    temp = compiled.memory_analysis().temp_size_in_bytes
    hlo = compiled.as_text()
    print(
        f"{mode} blocks of {block}: weights {q_bytes / 2**20:.0f} MiB for {n_params / 1e6:.0f} M "
        f"params ({q_bytes / n_params:.3f} B a param); decode forward temp {temp / 2**20:.1f} MiB"
    )
    assert "block_dequant_matmul" in hlo
    assert temp < MLP_KERNEL_BF16, temp
    assert _kernel_sized_bf16_outside_gemms(hlo) == []
