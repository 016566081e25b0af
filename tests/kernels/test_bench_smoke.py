"""The kernel benchmark scripts run end to end on tiny shapes (--smoke) and write JSON + markdown
(kernel_bench.py also with --plot: a PNG next to the JSON when matplotlib is installed)."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(
    "script,stem,extra",
    [
        ("kernel_bench.py", "kernels_cpu_smoke", ["--plot"]),
        ("_kernel_bench_gpu.py", "kernels_gpu_smoke", []),
    ],
)
def test_benchmark_smoke(script, stem, extra, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), str(tmp_path), "--smoke", *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads((tmp_path / f"{stem}.json").read_text())
    assert payload["environment"]["jax"] and payload["rows"]
    assert all("error" not in r for r in payload["rows"]), payload["rows"]
    assert (tmp_path / f"{stem}.md").read_text().startswith("| workload")
    have_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / f"{stem}.png").is_file() == ("--plot" in extra and have_matplotlib)
