"""Attention backends by name: which one ``"auto"`` picks on this platform, and the checks."""

from __future__ import annotations

import jax

BACKENDS = ("auto", "xla", "cpu", "pallas", "reference")


def resolve_backend(
    name: str,
    platform: str | None = None,
    *,
    head_size: int | None = None,
    block_size: int | None = None,
) -> tuple[str, bool]:
    """("auto" | "xla" | "cpu" | "pallas" | "reference") -> (backend, interpret).

    "auto" is Pallas on GPU/TPU and, on CPU (where Pallas only runs in interpret mode, ~100x
    slower than XLA, measured), the "cpu" backend (the C++ paged-attention kernel) when that
    kernel builds here, else the pure-XLA backend. On TPU "auto" keeps the XLA backend for
    shapes the Mosaic kernel refuses (head_size not a multiple of 128, block_size not a multiple
    of 8); an explicit "pallas" raises there instead. "pallas" on CPU means interpret mode.
    An explicit "cpu" off the CPU platform raises.
    """
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    platform = platform or jax.default_backend()
    if name == "auto":
        if platform == "tpu" and head_size is not None and block_size is not None:
            from jaxkv.pallas_kernels.mosaic_backend import check_shapes  # noqa: PLC0415

            try:
                check_shapes(head_size=head_size, block_size=block_size)
            except ValueError:
                return "xla", False
        if platform in ("gpu", "cuda", "rocm", "tpu"):
            return "pallas", False
        from jaxkv.pallas_kernels import cpu_backend  # noqa: PLC0415

        return ("cpu" if cpu_backend.available() else "xla"), False
    if name == "cpu" and platform != "cpu":
        raise ValueError(f"attention_backend='cpu' runs on the CPU platform only, not {platform!r}")
    return name, (name == "pallas" and platform == "cpu")
