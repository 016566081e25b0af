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
