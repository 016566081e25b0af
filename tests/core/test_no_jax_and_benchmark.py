"""The host core stays plain Python, and the overhead benchmark still runs."""

import ast
import importlib.util
import pathlib
import subprocess
import sys

import jaxkv.core
import jaxkv.sampling_params

ROOT = pathlib.Path(jaxkv.core.__file__).parent


def _imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_core_never_imports_jax():
    files = sorted(ROOT.glob("*.py")) + [pathlib.Path(jaxkv.sampling_params.__file__)]
    assert len(files) > 10
    for path in files:
        bad = [
            m
            for m in _imported_modules(path)
            if m.split(".")[0] in ("jax", "jaxlib", "flax", "numpy")
        ]
        assert not bad, f"{path.name} imports {bad}"


def test_connector_api_loads_no_jax():
    """The KV-connector API's scheduler side (base, config, factory, the storage and transfer
    connectors' scheduler roles) imports no jax: the engine core builds it without a device."""
    code = (
        "import sys; from jaxkv.distributed.kv_transfer import KVConnectorFactory, KVConnectorRole, "
        "KVTransferConfig; from jaxkv.kv_cache import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec; "
        "cfg = KVCacheConfig(8, (), (KVCacheGroupSpec(('l',), FullAttentionSpec(16, 1, 64, 'float32')),)); "
        "[KVConnectorFactory.create_connector(KVTransferConfig(n), KVConnectorRole.SCHEDULER, cfg) "
        " for n in ('SharedStorageConnector', 'JaxTransferConnector')]; "
        "assert 'jax' not in sys.modules, 'jax loaded'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parents[1])


def test_importing_the_core_loads_no_jax():
    """``import jaxkv.core`` (and the host-side names of ``jaxkv``) work without loading jax:
    the engine, which needs it, loads on first use of ``jaxkv.LLM``."""
    code = (
        "import sys, jaxkv.core, jaxkv; from jaxkv import SamplingParams, BeamSearchParams; "
        "assert 'jax' not in sys.modules, 'jax loaded'; jaxkv.LLM; assert 'jax' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parents[1])


def test_scheduler_overhead_benchmark_smoke(tmp_path):
    path = ROOT.parents[1] / "benchmarks" / "scheduler_overhead.py"
    spec = importlib.util.spec_from_file_location("scheduler_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "result.json"
    module.main(["--num-requests", "8", "--steps", "5", "--output", str(out), "--plot"])
    assert '"us_per_request_per_step"' in out.read_text()
    # --plot: a PNG next to the JSON when matplotlib is installed (CI does not install it)
    assert (tmp_path / "result.png").is_file() == (
        importlib.util.find_spec("matplotlib") is not None
    )
