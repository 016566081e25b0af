"""The deviceless H200 tier: a compile-only CUDA device, or a skip (a failure under CI=true)."""

import os

import jax
import pytest

from jaxkv import gpu_aot


@pytest.fixture(scope="session")
def h200():
    try:
        return gpu_aot.aot_device("h200")
    except RuntimeError as e:
        if os.environ.get("CI") == "true":  # .ci/run installs the plugin: this tier must run
            pytest.fail(f"the deviceless H200 tier cannot run in CI: {e}")
        pytest.skip(str(e))


@pytest.fixture(autouse=True)
def _no_persistent_cache():
    """Compile-only executables cannot be read back from the suite's persistent XLA cache
    (it warns "PjRtCompiler must be constructed with a Client"): off for this tier."""
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", was)
