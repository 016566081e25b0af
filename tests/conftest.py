"""Suite-wide settings."""

import os
import tempfile

from jaxkv.gpu_aot import prepare_environment

if not os.path.exists("/dev/nvidiactl"):   # no NVIDIA GPU: let the CUDA plugin register
    prepare_environment()                  # for deviceless compiles (tests/gpu_aot)

import jax  # noqa: E402
import pytest


@pytest.fixture(scope="session", autouse=True)
def _session_compile_cache():
    """Many tests build engines of the same small models with the same settings, so their
    jitted steps compile to identical programs: one persistent XLA cache per test session (a
    fresh directory, removed afterwards) compiles each once. ``JAXKV_TEST_NO_COMPILE_CACHE=1``
    turns it off."""
    if os.environ.get("JAXKV_TEST_NO_COMPILE_CACHE"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="jaxkv-test-xla-") as path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        yield
        jax.config.update("jax_compilation_cache_dir", None)
