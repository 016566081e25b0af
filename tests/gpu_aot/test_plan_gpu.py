"""``jaxkv plan --gpu h200``: the steps' memory and kernels on an H200, compiled deviceless."""

import re

import pytest

from jaxkv.entrypoints.cli import main

pytestmark = pytest.mark.gpu_aot


def test_plan_gpu_reports_steps_and_kernels(h200, capsys):
    code = main(
        [
            "plan",
            "--model",
            "tiny-llama",
            "--kv-cache-memory",
            "64MiB",
            "--max-model-len",
            "256",
            "--max-num-batched-tokens",
            "128",
            "--max-num-seqs",
            "8",
            "--gpu",
            "h200",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "H200 (deviceless compile" in out
    decode = re.search(
        r"decode step \(T=8, S=8\): temp ([\d.]+) MiB, arguments [\d.]+ GiB, aliased ([\d.]+) GiB",
        out,
    )
    assert decode, out
    assert float(decode.group(2)) == pytest.approx(
        64 / 1024, abs=0.01
    )  # the 64 MiB cache, in place
    kernels = re.findall(
        r"ragged_paged_attention_\w+: grid \[[\d, ]+\], \d+ threads, shared (\d+) B "
        r"\(limit (\d+)\), (\d+) registers, spills (\d+) B",
        out,
    )
    assert kernels and all(0 < int(s) <= int(lim) and int(sp) == 0 for s, lim, _, sp in kernels), (
        out
    )


def test_plan_gpu_with_int8_weights_counts_and_passes_a_byte_per_weight(h200, capsys):
    """``--quantization int8``: the report's weights are the int8 kernels plus their scales (the
    float embedding aside), and the compiled step takes them as its arguments (not floats)."""
    argv = ["plan", "--model", "tiny-llama", "--kv-cache-memory", "64MiB", "--max-model-len"]
    argv += ["256", "--max-num-batched-tokens", "128", "--max-num-seqs", "8", "--gpu", "h200"]
    found = {}
    for quantization in (None, "int8"):
        extra = [] if quantization is None else ["--quantization", quantization]
        assert main(argv + extra) == 0
        out = capsys.readouterr().out
        weights = re.search(r"weights ([\d.]+) GiB \((.+)\)", out)
        args = re.search(r"decode step \(T=8, S=8\): temp [\d.]+ MiB, arguments ([\d.]+) GiB", out)
        assert weights and args, out
        found[quantization] = float(weights.group(1)), weights.group(2), float(args.group(1))
    (w_f32, kind_f32, a_f32), (w_int8, kind_int8, a_int8) = found[None], found["int8"]
    assert (kind_f32, kind_int8) == ("float32", "int8 weight-only")
    # tiny-llama: 211.0 MiB of float32 parameters, 99.9 MiB with int8 kernels (62.5 MiB of them
    # the float32 embedding): the linear layers' bytes drop 4x, plus per-channel scales.
    assert w_f32 == pytest.approx(211.0 / 1024, abs=0.002)
    assert w_int8 == pytest.approx(99.9 / 1024, abs=0.002)
    assert a_f32 - a_int8 == pytest.approx(w_f32 - w_int8, abs=0.01)
