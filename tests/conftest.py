"""Suite-wide settings."""

import os
import tempfile

from jaxkv.gpu_aot import prepare_environment

if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA GPU: let the CUDA plugin register
    prepare_environment()  # for deviceless compiles (tests/gpu_aot)

import jax
import pytest

from jaxkv import compile_cache


@pytest.fixture(scope="session", autouse=True)
def _session_compile_cache():
    """Many tests build engines of the same small models with the same settings, so their
    programs compile to identical executables: one persistent XLA cache per test session (a
    fresh directory, removed afterwards; engines and the processes the tests start use it
    through ``JAXKV_COMPILE_CACHE``) compiles each once, and the user's own cache is never
    touched. ``JAXKV_TEST_NO_COMPILE_CACHE=1`` turns it off."""
    if os.environ.get("JAXKV_TEST_NO_COMPILE_CACHE"):
        os.environ[compile_cache.ENV] = "off"
        yield
        return
    with tempfile.TemporaryDirectory(prefix="jaxkv-test-xla-") as path:
        os.environ[compile_cache.ENV] = path
        compile_cache.enable(path)
        yield
        jax.config.update("jax_compilation_cache_dir", None)
        os.environ.pop(compile_cache.ENV, None)
