"""The error a failed engine step raises, and how code names the request it was handling.

Code that works on one request at a time (the worker's per-row loops, the engine's output
processing) marks an exception raised there with that request's id (``blame``); the
engine then names it in the ``EngineStepError`` it raises (``culprit_of``).
"""

from __future__ import annotations

from collections.abc import Iterable

_CULPRIT_ATTR = "_jaxkv_request_id"


def blame(exc: BaseException, request_id: str | None) -> None:
    """Marks ``exc`` as raised while handling ``request_id`` (the innermost mark wins)."""
    if request_id is not None and getattr(exc, _CULPRIT_ATTR, None) is None:
        try:
            setattr(exc, _CULPRIT_ATTR, request_id)
        except (AttributeError, TypeError):  # an exception type without a __dict__
            pass


def _chain(exc: BaseException | None):
    """``exc``, then what it was raised from or during (``__cause__``, else ``__context__``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def culprit_of(exc: BaseException) -> str | None:
    """The request id ``blame`` put on ``exc`` (or on the exception it was raised from)."""
    for e in _chain(exc):
        rid = getattr(e, _CULPRIT_ATTR, None)
        if rid is not None:
            return rid
    return None


def caused_by_interrupt(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among the causes of ``exc``. jax's jit cache re-raises
    an interrupt that lands in a static argument's ``__eq__`` as a ValueError holding the
    interrupt's traceback as text, hence the second test."""
    return any(
        isinstance(e, KeyboardInterrupt) or "\nKeyboardInterrupt" in str(e) for e in _chain(exc)
    )


class EngineStepError(RuntimeError):
    """``LLMEngine.step`` failed; the engine undid the step and is usable again.

    The original exception is the ``__cause__``. Every request of the failed step (and
    the other completions of their parents) was finished as aborted: its blocks are free,
    and the blocks cached for its unwritten tokens were removed from the prefix cache.

    Attributes:
        request_id: The request being handled when it failed, when that is known.
        aborted_request_ids: The (user-facing) requests the engine aborted.
        kv_cache_lost: True when the KV buffers had to be re-created (their step failed
            after they were donated): every other running request is recomputed.
    """

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        aborted_request_ids: Iterable[str] = (),
        kv_cache_lost: bool = False,
    ):
        super().__init__(message)
        self.request_id = request_id
        self.aborted_request_ids = tuple(aborted_request_ids)
        self.kv_cache_lost = kv_cache_lost
