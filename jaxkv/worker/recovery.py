"""The runner's device state after a failed step: what a failed call took with it.

A jitted call donates its inputs (KV buffers, block tables, the last sampled tokens, the
sampling state); when it fails, a donated array is deleted or holds the call's error, and the
runner re-creates it (``ModelRunner.recover_after_failure``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax

T = TypeVar("T")


def lost(x: jax.Array) -> bool:
    """True when ``x`` was donated to a call that failed, or holds that call's error."""
    try:
        if x.is_deleted():
            return True
        x.block_until_ready()
    except Exception:  # noqa: BLE001 - any error reading it back means it is unusable
        return True
    return False


def replace_lost(tree: T, make: Callable[[], T]) -> tuple[T, bool]:
    """``(tree, False)`` when every leaf of ``tree`` is usable, else ``(make(), True)``."""
    if any(lost(x) for x in jax.tree_util.tree_leaves(tree)):
        return make(), True
    return tree, False
