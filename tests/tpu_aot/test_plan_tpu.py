"""``jaxkv plan --tpu v5e|v6e|v7x``: the steps' memory and Mosaic kernels, compiled deviceless."""

import os
import re
import subprocess
import sys

import pytest

from jaxkv.entrypoints.cli import main


def test_plan_tpu_needs_heads_of_128(capsys):
    """tiny-llama's heads of 64 are refused by name before anything compiles."""
    code = main(["plan", "--model", "tiny-llama", "--kv-cache-memory", "64MiB", "--tpu", "v5e"])
    assert code != 0
    assert "head_dim to be a multiple of 128, got 64" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.tpu_aot
@pytest.mark.tpu_aot_full
def test_plan_tpu_reports_steps_and_kernels(tpu):
    """In a process of its own, as a user runs it: libtpu loads after the command set its dump
    flag, so each kernel's SMEM (from Mosaic's dumps) is reported next to its VMEM."""
    tpu("v6e")  # skips (fails in CI) without libtpu
    argv = (
        "plan --model gemma3-270m --dtype bfloat16 --kv-cache-memory 64MiB --max-model-len 1024 "
        "--max-num-batched-tokens 128 --max-num-seqs 8 --tpu v6e"
    ).split()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu", "JAXKV_COMPILE_CACHE": "off"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxkv.entrypoints.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=root,
    )
    out = proc.stdout
    assert proc.returncode == 0, (out, proc.stderr[-3000:])
    assert "TPU v6e (TPU v6 lite, deviceless compile" in out
    decode = re.search(
        r"decode step \(T=8, S=8\): temp ([\d.]+) MiB, arguments [\d.]+ GiB, aliased ([\d.]+) GiB",
        out,
    )
    assert decode and float(decode.group(2)) == pytest.approx(64 / 1024, abs=0.01), out  # in place
    kernels = re.findall(
        r"ragged_paged_attention_mosaic\w*: VMEM (\d+) B \(scoped limit (\d+)\), "
        r"SMEM (\d+) B \(core (\d+)\)",
        out,
    )
    assert kernels, out
    for vmem, vmem_limit, smem, smem_limit in kernels:
        assert 0 < int(vmem) <= int(vmem_limit), out
        assert 0 < int(smem) <= int(smem_limit) == 1 << 20, out
