"""The deviceless TPU tier: compile-only TPU devices, or a skip (a failure under CI=true)."""

import os

import jax
import pytest

from jaxkv import tpu_aot

tpu_aot.prepare_environment()  # several libtpu processes (pytest-xdist) before jax loads it


def _devices(mesh: bool):
    devices = {}

    def get(generation: str):
        if generation not in devices:
            try:
                devices[generation] = tpu_aot.aot_device(generation, mesh=mesh)
            except RuntimeError as e:
                if os.environ.get("CI") == "true":  # .ci/run installs libtpu: this tier must run
                    pytest.fail(f"the deviceless TPU tier cannot run in CI: {e}")
                pytest.skip(str(e))
        return devices[generation]

    return get


@pytest.fixture(scope="session")
def tpu():
    """``tpu(generation)`` -> a compile-only device of that TPU generation."""
    return _devices(mesh=False)


@pytest.fixture(scope="session")
def tpu_slice():
    """``tpu_slice(generation)`` -> the compile-only devices of a 4-chip slice of it."""
    return _devices(mesh=True)


@pytest.fixture(autouse=True)
def _no_persistent_cache():
    """Compile-only executables cannot be read back from the suite's persistent XLA cache:
    off for this tier (as in tests/gpu_aot)."""
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", was)


def pytest_collection_modifyitems(config, items):
    """``tpu_aot_full`` (the long part of this tier) runs only with JAXKV_TPU_AOT_FULL=1, as CI's
    newest-jax leg sets it: the README's test command stays as it is."""
    if os.environ.get("JAXKV_TPU_AOT_FULL") == "1":
        return
    skip = pytest.mark.skip(
        reason="the long part of the TPU tier: set JAXKV_TPU_AOT_FULL=1 to run it"
    )
    for item in items:
        if "tpu_aot_full" in item.keywords:
            item.add_marker(skip)
