"""Attention backends by name: which one ``"auto"`` picks on this platform, and the checks."""

from __future__ import annotations

import jax

from jaxkv.models.config import BACKENDS as MODEL_BACKENDS

#: ``attention_backend`` values: "auto" (picked per platform, ``resolve_backend``), then the
#: backends a model's ``KVCacheBinding`` runs.
BACKENDS = ("auto", *MODEL_BACKENDS)


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
            from jaxkv.pallas_kernels.mosaic_backend import check_shapes

            try:
                check_shapes(head_size=head_size, block_size=block_size)
            except ValueError:
                return "xla", False
        if platform in ("gpu", "cuda", "rocm", "tpu"):
            return "pallas", False
        from jaxkv.pallas_kernels import cpu_backend

        return ("cpu" if cpu_backend.available() else "xla"), False
    if name == "cpu" and platform != "cpu":
        raise ValueError(f"attention_backend='cpu' runs on the CPU platform only, not {platform!r}")
    return name, (name == "pallas" and platform == "cpu")


def resolve_kv_layout(
    backend: str,
    interpret: bool,
    platform: str | None = None,
    *,
    head_size: int,
    block_size: int,
    cache_dtype,
) -> str:
    """The KV buffer layout (``kv_memory.KV_LAYOUTS``) of a resolved backend on ``platform``.

    "words" (flat uint32 of TPU-packed tiles, ``layout.kv_cache_word_view``) for the compiled
    Pallas backend on TPU when the sizes allow it (head_size a multiple of 128, block_size a
    multiple of 8 / 16 / 32 for 4- / 2- / 1-byte caches): its per-layer views are free under
    TPU tiling and its Mosaic KV write compiles. "bytes" (flat uint8) everywhere else: there a
    TPU pays a relayout of the cache per step (the byte view of a bf16 page is not a view under
    TPU tiling), which the "auto" backend avoids only by being XLA for such shapes.
    """
    platform = platform or jax.default_backend()
    if backend != "pallas" or interpret or platform != "tpu":
        return "bytes"
    from jaxkv.pallas_kernels.layout import check_word_layout

    try:
        check_word_layout(block_size=block_size, head_size=head_size, dtype=cache_dtype)
    except ValueError:
        return "bytes"
    return "words"


def check_kv_layout(
    layout: str, backend: str, *, head_size: int, block_size: int, cache_dtype
) -> None:
    """ValueError unless ``backend`` can run on KV buffers of ``layout``: the word layout needs
    the Pallas backend (its Mosaic write and attention; interpret mode off a TPU) and sizes it
    can pack (``layout.check_word_layout``)."""
    from jaxkv.worker.kv_memory import buffer_dtype

    buffer_dtype(layout)
    if layout == "words":
        if backend != "pallas":
            raise ValueError(
                f"the TPU word KV layout runs with attention_backend='pallas' only, not {backend!r}"
            )
        from jaxkv.pallas_kernels.layout import check_word_layout

        check_word_layout(block_size=block_size, head_size=head_size, dtype=cache_dtype)


def bind_attention(
    name: str,
    kv_cache_config,
    *,
    head_size: int,
    cache_dtype: str,
    k_scale: float | None = None,
    v_scale: float | None = None,
    mesh=None,
):
    """A runner's attention set-up for ``kv_cache_config``: backend ``name`` resolved on this
    platform (``resolve_backend``), the layers' ``KVCacheBinding`` and the KV buffer layout on
    the mesh's platform (``resolve_kv_layout``). Returns ``(binding, kv_layout)``."""
    from jaxkv.models.config import KVCacheBinding

    block_size = kv_cache_config.block_size
    backend, interpret = resolve_backend(name, head_size=head_size, block_size=block_size)
    binding = KVCacheBinding(
        layers=tuple((n, g, t) for n, (g, t) in kv_cache_config.layer_binding().items()),
        block_size=block_size,
        cache_dtype=cache_dtype,
        backend=backend,
        interpret=interpret,
        k_scale=k_scale,
        v_scale=v_scale,
        mesh=mesh,
    )
    platform = mesh.devices.flat[0].platform if mesh is not None else None
    kv_layout = resolve_kv_layout(
        backend,
        interpret,
        platform,
        head_size=head_size,
        block_size=block_size,
        cache_dtype=cache_dtype,
    )
    return binding, kv_layout
