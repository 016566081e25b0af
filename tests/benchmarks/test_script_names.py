"""No benchmark script shares its name with an installed top-level package.

The benchmarks folder goes on ``sys.path`` (``jaxkv bench``, the benchmark tests), and a script
there named like a package shadows it for the whole process: ``benchmarks/kernels.py`` once
broke transformers, which imports the ``kernels`` package when it finds one.
"""

import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def test_no_script_shadows_an_installed_package():
    scripts = {p.stem for p in BENCH.glob("*.py")}
    assert "throughput" in scripts
    installed = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    assert {"numpy", "jax"} <= installed  # the distributions are listed at all
    assert not scripts & installed, sorted(scripts & installed)


def test_transformers_imports_with_the_benchmarks_on_the_path():
    """transformers probes for optional packages (``kernels``, ``accelerate``...) by name."""
    pytest.importorskip("transformers")
    code = "import transformers.activations, transformers.models.llama.modeling_llama"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(BENCH)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
