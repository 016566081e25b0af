"""A guard that makes any concrete random initialisation raise (abstract ones, under
``nnx.eval_shape`` or ``jax.jit`` tracing, pass): what a checkpoint load must never do."""

from __future__ import annotations

import contextlib

import jax
import jax._src.random as jax_random_impl


class ConcreteRandomInitError(AssertionError):
    pass


@contextlib.contextmanager
def forbid_concrete_random_init(monkeypatch):
    """Within the block, ``jax.random.normal`` (what ``jaxkv.models.layers.normal_init``
    calls, and the implementation ``nnx.initializers`` call) raises on a concrete key."""
    real = jax.random.normal

    def guarded(key, *args, **kwargs):
        if not isinstance(key, jax.core.Tracer):
            raise ConcreteRandomInitError(f"concrete random init of shape {args[:1]}")
        return real(key, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(jax.random, "normal", guarded)
        m.setattr(jax_random_impl, "normal", guarded)
        yield
