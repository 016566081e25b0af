"""benchmarks/gpu_check.sh without a GPU: its argument checks, and the benchmark's ``--aot``
path (what the script's dry run, ``GPU_CHECK_DRYRUN=1``, runs in place of timing)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _run(env_extra, tmp_path, timeout=120):
    env = dict(os.environ, **env_extra)
    return subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_settings_and_no_gpu_exit_2(tmp_path):
    proc = _run({"GPU_CHECK_DRYRUN": "yes"}, tmp_path)
    assert proc.returncode == 2 and "GPU_CHECK_DRYRUN must be 0 or 1" in proc.stderr, proc.stderr
    proc = _run({"GPU_CHECK_PARTS": "tests,bench,typo"}, tmp_path)
    assert proc.returncode == 2 and "unknown part 'typo'" in proc.stderr, proc.stderr
    if not os.path.exists("/dev/nvidiactl"):  # the real run refuses a machine without a GPU
        proc = _run({"GPU_CHECK_DRYRUN": "0", "GPU_CHECK_PARTS": "tests"}, tmp_path)
        assert proc.returncode == 2 and "jax sees no GPU" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.gpu_aot
@pytest.mark.gpu_aot_full
def test_kernel_benchmark_compiles_for_the_h200(h200, tmp_path):
    """``_kernel_bench_gpu.py --aot h200 --smoke``: every smoke workload compiled, not run."""
    proc = subprocess.run(
        [sys.executable, "_kernel_bench_gpu.py", str(tmp_path), "--smoke", "--aot", "h200"],
        cwd=ROOT / "benchmarks",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((tmp_path / "kernels_gpu_aot_h200.json").read_text())
    backends = {(r["workload"], r["backend"]) for r in payload["rows"]}
    assert ("decode-b2-c64", "pallas") in backends and (
        "decode-b2-c64",
        "jax-pallas-paged",
    ) in backends
    assert not payload["failed"] and all(
        "ragged_paged_attention" in r["kernels"]
        for r in payload["rows"]
        if r["backend"] == "pallas"
    )
    assert {r["backend"] for r in payload["view_copy_check"]} == {"pallas", "xla"}
    assert not any(r["copies_cache"] for r in payload["view_copy_check"])
