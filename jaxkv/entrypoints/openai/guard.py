"""What every HTTP request passes before the app sees it (plain ASGI, so streamed responses and
disconnects pass through untouched), in this order:

1. Host and Origin: with ``allowed_hosts`` (the default when the server listens on a loopback
   address: ``localhost``, ``127.0.0.1``, ``::1``), a request whose ``Host`` header names
   another host, or whose ``Origin`` header names another host, is a 403. A web page the
   user visits cannot drive a key-less local server through the browser: not directly (its
   Origin is refused) and not by DNS rebinding (its Host is its own name).
2. The API key (``/v1`` routes): ``Authorization: Bearer KEY``, 401 otherwise.
3. JSON only: a POST whose ``Content-Type`` is not ``application/json`` is a 415, so no
   browser can send one cross-site without a CORS preflight (which this server never grants).
4. The body: a ``Content-Length`` over ``max_body_bytes`` is a 413 before a byte is read, a
   chunked body is cut with a 413 when it passes the limit, a body not received within
   ``body_timeout_s`` is a 408; each of them closes the connection. A client that leaves while
   uploading ends its request quietly. The app then reads the buffered body.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from urllib.parse import urlsplit

logger = logging.getLogger("uvicorn.error")  # uvicorn configures it: its format, its level

#: The names a loopback server answers to by default (``--allowed-hosts``).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """``host`` (a listening address) reaches this machine only."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(listen_host: str) -> frozenset[str] | None:
    """Loopback names (and the listening address) when listening on loopback; None (any host)
    otherwise: a server reachable from other machines is named in ways it cannot know."""
    if not is_loopback(listen_host):
        return None
    return frozenset({*LOOPBACK_NAMES, normalise_host(listen_host)})


def normalise_host(name: str) -> str:
    """``Host``-header style name -> the bare lower-case host: ``[::1]:8000`` -> ``::1``,
    ``LocalHost.:8000`` -> ``localhost``."""
    name = name.strip().lower()
    if name.startswith("["):  # [v6]:port
        return name[1 : name.find("]")] if "]" in name else name
    if name.count(":") == 1:
        name = name.split(":", 1)[0]
    return name.rstrip(".")


def parse_allowed_hosts(values: list[str] | None, listen_host: str) -> frozenset[str] | None:
    """``--allowed-hosts`` -> the set of names (None: any, ``*``); default per listening address."""
    if values is None:
        return default_allowed_hosts(listen_host)
    if "*" in values:
        return None
    names = frozenset(normalise_host(v) for v in values if v.strip())
    if not names:
        raise ValueError(f"--allowed-hosts needs at least one name (or '*'), got {values!r}")
    return names


def _error(status: int, message: str, param: str | None = None, *, close: bool = False):
    """A plain ASGI response in OpenAI's error shape (``close``: the connection closes after)."""
    from jaxkv.entrypoints.openai.serving_engine import OpenAIError

    body = json.dumps(OpenAIError(status, message, param).body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))

    async def respond(send):
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return respond


class RequestGuard:
    """The checks above, in front of ``app``.

    Args:
      app: the ASGI app.
      allowed_hosts: the names ``Host`` and ``Origin`` may carry (None: any).
      api_key: the key ``/v1`` routes need (None: none).
      max_body_bytes: the largest request body.
      body_timeout_s: the longest time to receive a body, from its request's head.
    """

    def __init__(
        self,
        app,
        *,
        allowed_hosts: frozenset[str] | None = None,
        api_key: str | None = None,
        max_body_bytes: int = 8 << 20,
        body_timeout_s: float = 60.0,
    ):
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty (an empty key would refuse every request)")
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.expected_auth = f"Bearer {api_key}".encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)  # the first of a repeated header
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            return await refusal(send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            receive = await self._buffered_body(headers, receive, send)
            if receive is None:
                return None
        return await self.app(scope, receive, send)

    def _refusal(self, scope, headers):
        if self.allowed_hosts is not None:
            host = normalise_host(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed_hosts:
                return _error(
                    403,
                    f"Host {host[:100]!r} is not allowed: this server answers to "
                    f"{sorted(self.allowed_hosts)} (--allowed-hosts)",
                )
            origin = headers.get(b"origin")
            if origin is not None:
                origin_host = _origin_host(origin.decode("latin-1"))
                if origin_host not in self.allowed_hosts:
                    return _error(
                        403,
                        f"Origin {origin.decode('latin-1')[:100]!r} is not allowed: "
                        f"cross-site requests are refused (--allowed-hosts)",
                    )
        if (
            self.expected_auth is not None
            and scope["path"].startswith("/v1")
            and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected_auth)
        ):
            return _error(
                401, "Unauthorized: a valid API key is needed (Authorization: Bearer KEY)"
            )
        if scope["method"] in ("POST", "PUT", "PATCH"):
            media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
            if media != b"application/json":
                return _error(
                    415,
                    f"Content-Type must be application/json, got "
                    f"{media.decode('latin-1')[:60] or 'none'!r}",
                    close=True,
                )
        return None

    async def _buffered_body(self, headers, receive, send):
        """The body read in full under the limits, as a replaying ``receive`` (None: refused,
        answered, or the client left)."""
        limit = self.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _error(
                413,
                f"the request body has {int(length)} bytes: at most {limit} are allowed "
                "(--max-request-body)",
                close=True,
            )(send)
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await _error(
                    408,
                    f"the request body was not received within {self.body_timeout_s:g} s "
                    f"({size} bytes came; --timeout-body-read)",
                    close=True,
                )(send)
                return None
            if message["type"] == "http.disconnect":
                logger.info(
                    "a client left while sending its request body (%d bytes received)", size
                )
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _error(
                    413,
                    f"the request body has more than {limit} bytes (--max-request-body)",
                    close=True,
                )(send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay():
            nonlocal replayed, body
            if not replayed:
                replayed = True
                message, body = {"type": "http.request", "body": body, "more_body": False}, b""
                return message
            return await receive()  # the disconnect, when it comes

        return replay


def _origin_host(origin: str) -> str | None:
    """``http://localhost:3000`` -> ``localhost``; ``null`` and junk -> None."""
    try:
        host = urlsplit(origin.strip()).hostname
    except ValueError:
        return None
    return host.rstrip(".") if host else None
