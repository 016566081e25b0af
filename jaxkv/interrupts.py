"""Ctrl-C during an engine step: finish the step, then raise (a second Ctrl-C raises at once).

An interrupt landing at an arbitrary point of a step can leave host structures half
updated, or drop the outputs of a jitted call whose inputs (the KV buffers) were already
donated. ``DeferredInterrupt`` holds a SIGINT that arrives inside its block and reports
it (``pending``) when the block ends, so the step completes and the engine raises
KeyboardInterrupt between steps. A second SIGINT inside the block raises at once (a user
who insists is not kept waiting for a long compile); the engine's recovery handles that.

Only the main thread receives signals, and only Python's default handler is replaced:
inside another thread, or under a handler the program installed itself, the block runs
unguarded.
"""

from __future__ import annotations

import signal
import threading


class DeferredInterrupt:
    """Context manager; see the module docstring. ``pending`` is True when a SIGINT came."""

    def __init__(self):
        self.pending = False
        self._installed = False

    def _handler(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def __enter__(self) -> DeferredInterrupt:
        self.pending = False
        self._installed = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if self._installed:
            try:
                signal.signal(signal.SIGINT, self._handler)
            except BaseException:  # an interrupt landing here: no __exit__ would undo it
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise
        return self

    def __exit__(self, *exc_info) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._installed = False
