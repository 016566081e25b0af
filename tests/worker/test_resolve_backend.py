"""Which attention backend "auto" and the explicit names resolve to, per platform and shape."""

import pytest

from jaxkv.worker import resolve_backend


@pytest.mark.parametrize(
    "platform, head, bs, want",
    [
        ("gpu", 64, 16, ("pallas", False)),
        ("tpu", 128, 16, ("pallas", False)),
        ("tpu", 64, 16, ("xla", False)),  # Mosaic needs head_size % 128 == 0
        ("tpu", 128, 4, ("xla", False)),  # ... and block_size % 8 == 0
    ],
)
def test_auto(platform, head, bs, want):
    assert resolve_backend("auto", platform, head_size=head, block_size=bs) == want


def test_auto_on_cpu_is_the_cpu_backend_when_its_kernel_builds(monkeypatch):
    from jaxkv.pallas_kernels import cpu_backend

    monkeypatch.setattr(cpu_backend, "available", lambda: True)
    assert resolve_backend("auto", "cpu", head_size=64, block_size=16) == ("cpu", False)
    monkeypatch.setattr(cpu_backend, "available", lambda: False)  # no compiler: pure XLA
    assert resolve_backend("auto", "cpu", head_size=64, block_size=16) == ("xla", False)


def test_explicit_names_and_errors():
    assert resolve_backend("pallas", "cpu") == ("pallas", True)  # interpret mode on CPU
    assert resolve_backend("xla", "gpu") == ("xla", False)
    assert resolve_backend("reference", "tpu") == ("reference", False)
    assert resolve_backend("cpu", "cpu") == ("cpu", False)
    with pytest.raises(ValueError, match="'triton'"):
        resolve_backend("triton", "gpu")
    with pytest.raises(ValueError, match="CPU platform only"):
        resolve_backend("cpu", "gpu")
