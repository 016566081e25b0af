"""One host->device transfer per step: pack many small int32/float32 arrays into one buffer.

The host builds a record (a dataclass, e.g. ``ForwardInputs``) of numpy arrays,
:func:`pack_record` concatenates them into one flat int32 array (4-byte values are bitcast,
bools widened) and returns a hashable :class:`PackSpec`; inside the compiled program
:func:`unpack_record` slices and bitcasts them back into the same record type. A program is
built for one spec, so every record's shapes are fixed by its program's key.

Example: ``pack({"ids": int32[4], "temp": float32[2]})`` -> int32[6] and
``PackSpec((("ids", (4,), "int32", 0), ("temp", (2,), "float32", 4)))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

_FOUR_BYTE = {"int32", "float32", "uint32"}


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """(name, shape, dtype name, offset) per array, in packing order; hashable."""

    fields: tuple[tuple[str, tuple[int, ...], str, int], ...]

    @property
    def size(self) -> int:
        if not self.fields:
            return 0
        _, shape, _, offset = self.fields[-1]
        return offset + int(np.prod(shape, dtype=np.int64))


def pack(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, PackSpec]:
    """Flattens ``arrays`` (int32 / uint32 / float32 / bool) into one int32 numpy array."""
    parts, fields, offset = [], [], 0
    for name, a in arrays.items():
        a = np.asarray(a)
        if a.dtype == np.bool_:
            a, dtype = a.astype(np.int32), "bool"
        else:
            dtype = a.dtype.name
            if dtype not in _FOUR_BYTE:
                raise TypeError(
                    f"cannot pack {name!r} of dtype {dtype}; use int32, uint32, float32 or bool"
                )
        flat = np.ascontiguousarray(a).reshape(-1).view(np.int32)
        parts.append(flat)
        fields.append((name, tuple(int(d) for d in a.shape), dtype, offset))
        offset += flat.size
    buf = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    return buf, PackSpec(tuple(fields))


def unpack(buf: jax.Array, spec: PackSpec) -> dict[str, jax.Array]:
    """Inverse of :func:`pack` on the device: ``buf`` [spec.size] int32 -> dict of arrays."""
    if buf.shape != (spec.size,):
        raise ValueError(f"packed buffer has shape {buf.shape}, spec needs ({spec.size},)")
    out = {}
    for name, shape, dtype, offset in spec.fields:
        n = int(np.prod(shape, dtype=np.int64))
        x = buf[offset : offset + n].reshape(shape)
        if dtype == "bool":
            x = x != 0
        elif dtype != "int32":
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
        out[name] = x
    return out


def unpack_host(buf: np.ndarray, spec: PackSpec) -> dict[str, np.ndarray]:
    """:func:`unpack` on the host (for results coming back from the device)."""
    out = {}
    for name, shape, dtype, offset in spec.fields:
        n = int(np.prod(shape, dtype=np.int64))
        x = buf[offset : offset + n].reshape(shape)
        out[name] = (x != 0) if dtype == "bool" else x.view(np.dtype(dtype))
    return out


def pack_device(arrays: Mapping[str, jax.Array]) -> tuple[jax.Array, PackSpec]:
    """:func:`pack` inside a jitted function (for results going back to the host)."""
    parts, fields, offset = [], [], 0
    for name, a in arrays.items():
        if a.dtype == jnp.bool_:
            flat, dtype = a.astype(jnp.int32).reshape(-1), "bool"
        elif a.dtype.name in _FOUR_BYTE:
            dtype = a.dtype.name
            flat = a.reshape(-1)
            if dtype != "int32":
                flat = jax.lax.bitcast_convert_type(flat, jnp.int32)
        else:
            raise TypeError(f"cannot pack {name!r} of dtype {a.dtype}")
        parts.append(flat)
        fields.append((name, tuple(a.shape), dtype, offset))
        offset += flat.size
    buf = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.int32)
    return buf, PackSpec(tuple(fields))


# ---- typed records: a dataclass of arrays packed the same way ------------------------------------


def record_arrays(record) -> dict:
    """A dataclass record's fields as ``{name: array}`` in field order (no copies)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


def pack_record(record) -> tuple[np.ndarray, PackSpec]:
    """:func:`pack` of a dataclass of numpy arrays (its fields in order)."""
    return pack(record_arrays(record))


def unpack_record(buf: jax.Array, spec: PackSpec, cls):
    """:func:`unpack` on the device into an instance of the dataclass ``cls``."""
    return cls(**unpack(buf, spec))


def unpack_record_host(buf: np.ndarray, spec: PackSpec, cls):
    """:func:`unpack_host` into an instance of the dataclass ``cls``."""
    return cls(**unpack_host(buf, spec))
