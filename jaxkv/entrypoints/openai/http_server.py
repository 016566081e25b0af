"""uvicorn, as ``jaxkv serve`` runs it: connections that cannot be held open by slow or idle
clients, and a stop that shuts the engine down.

- ``guarded_h11_protocol``: uvicorn's h11 protocol with a deadline on each request's head
  (from the connection's start, or from the previous response: a client sending a header
  byte a second is cut, where uvicorn's keep-alive timer restarts on every byte) and a cap on
  open connections (one more is answered 503 and closed at once).
- ``ServeServer``: SIGINT / SIGTERM stop it gracefully (uvicorn re-raises the signal after its
  shutdown, which killed the process before the engine core was stopped): open requests end
  first (streams with an error event, whole responses with a 503), then connections close,
  then the caller shuts the engine core down. When the engine core dies the server stops
  with exit code 1, unless told to keep answering 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import threading

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclasses.dataclass(frozen=True)
class HTTPOptions:
    """Connection handling (``jaxkv serve``'s flags; ``None``: no limit)."""

    allowed_hosts: frozenset[str] | None = None
    timeout_keep_alive_s: float = 5.0  # an idle keep-alive connection is closed
    timeout_header_read_s: float = 10.0  # a request's head must arrive within this
    timeout_body_read_s: float = 60.0  # ... and its body within this after the head
    max_connections: int = 2048  # open connections; one more is answered 503
    keep_serving_on_core_death: bool = False

    def __post_init__(self):
        for name in ("timeout_keep_alive_s", "timeout_header_read_s", "timeout_body_read_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if (
            isinstance(self.max_connections, bool)
            or not isinstance(self.max_connections, int)
            or self.max_connections < 1
        ):
            raise ValueError(f"max_connections must be an int >= 1, got {self.max_connections!r}")


def _raw_response(status: int, reason: str, message: str) -> bytes:
    from jaxkv.entrypoints.openai.serving_engine import OpenAIError

    body = json.dumps(OpenAIError(status, message).body()).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body


def guarded_h11_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's ``H11Protocol`` with a request-head deadline and a connection cap."""
    timeout_response = _raw_response(
        408,
        "Request Timeout",
        f"the request head was not received within {header_timeout_s:g} s (--timeout-header-read)",
    )
    busy_response = _raw_response(
        503,
        "Service Unavailable",
        f"the server has {max_connections} open connections (--max-connections)",
    )

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_started = False  # bytes came while waiting for a head (else an idle keep-alive)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.connections.discard(self)
                transport.write(busy_response)
                transport.close()
                return
            self._arm_head_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._head_timer is not None:
                self._head_started = True
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's head arrived
                self._cancel_head_timer()

        def on_response_complete(self) -> None:
            self._arm_head_timer()  # the next request's head (a pipelined one cancels it at once)
            super().on_response_complete()

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_started = False
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                if self._head_started:  # an idle connection is closed without a word
                    self.transport.write(timeout_response)
                self.transport.close()

    return GuardedH11Protocol


class ServeServer(uvicorn.Server):
    """``uvicorn.Server`` whose stop is the caller's to finish (no re-raised signal).

    Args:
      config: uvicorn's config.
      on_stop: called once when the server starts to shut down (ends the open requests).
      core_proc: the engine-core process, watched unless ``keep_serving_on_core_death``.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        on_stop=None,
        core_proc=None,
        keep_serving_on_core_death: bool = False,
    ):
        super().__init__(config)
        self.on_stop = on_stop
        self.core_proc = core_proc
        self.keep_serving_on_core_death = keep_serving_on_core_death
        self.exit_code = 0
        self.stop_signal: int | None = None
        self._core_watch: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT / SIGTERM set ``should_exit`` (a second SIGINT forces it); nothing is
        re-raised afterwards, so the caller's ``finally`` runs and the exit code is 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.core_proc is not None and not self.keep_serving_on_core_death:
            self._core_watch = asyncio.get_running_loop().create_task(
                self._watch_core(), name="jaxkv-core-death"
            )

    async def _watch_core(self) -> None:
        from jaxkv.engine.core_client import wait_for_exit

        await wait_for_exit(self.core_proc, asyncio.get_running_loop())
        if self.should_exit:
            return
        print(
            f"jaxkv serve: error: the engine core died (exit code {self.core_proc.poll()}); stopping the "
            "server (--keep-serving-on-core-death keeps it up, answering 503)",
            file=sys.stderr,
            flush=True,
        )
        self.exit_code = 1
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self._core_watch is not None:
            self._core_watch.cancel()
            with contextlib.suppress(BaseException):
                await self._core_watch
        if self.on_stop is not None:
            self.on_stop()
        await super().shutdown(sockets=sockets)
