"""The prefill/decode disaggregation proxy (vLLM's disaggregated-serving proxy example).

``jaxkv proxy --prefill URL [URL ...] --decode URL [URL ...] --port 8000`` serves
``/v1/completions`` and ``/v1/chat/completions``: each request goes first to a prefill
instance with ``max_tokens=1``, ``stream=false`` and ``kv_transfer_params={"do_remote_decode":
true}``; the ``kv_transfer_params`` P answers with go, with the original request, to a decode
instance, whose answer (streamed or whole) is relayed as it comes. Instances are taken round
robin. A prefill instance that fails (no answer, or a 5xx) or returns no parameters is skipped
(its 4xx goes back to the client): the decode instance then computes the prompt itself (the
answer is the same, only slower). A decode request whose connection broke before any answer
is sent once more; a decode instance that cannot be reached is a 502. The instances are
``jaxkv serve`` servers started with ``--kv-transfer-config`` (``kv_producer`` /
``kv_consumer``).
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' annotations
# (``request: Request``) as objects, and ``Request`` is imported inside ``build_app``.
import contextlib
import itertools
import json
import logging

logger = logging.getLogger(__name__)


def build_app(prefill: list[str], decode: list[str], *, timeout_s: float = 600.0, transport=None):
    """The FastAPI app over these prefill and decode base URLs (``http://host:port``);
    ``transport``: an httpx transport for the instances (tests)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    if not prefill or not decode:
        raise ValueError(
            f"need at least one prefill and one decode URL, got {prefill!r} and {decode!r}"
        )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()

    app = FastAPI(title="jaxkv P/D proxy", lifespan=lifespan)
    # Pooled connections expire before the instances' keep-alive timeout (5 s by default), so
    # a request is not sent on a connection the instance is closing at that moment.
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=httpx.Limits(keepalive_expiry=2.0),
        transport=transport,
    )
    next_p, next_d = itertools.cycle(prefill), itertools.cycle(decode)
    app.state.stats = {"requests": 0, "prefill_failures": 0}

    def forward_headers(request: Request) -> dict:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    async def prefill_params(path: str, body: dict, headers: dict):
        p_body = dict(
            body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True}
        )
        p_body.pop("stream_options", None)
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        url = next(next_p) + path
        try:
            r = await client.post(url, json=p_body, headers=headers)
        except httpx.HTTPError as exc:
            logger.warning("prefill %s failed: %s; decode computes the prompt", url, exc)
            return None
        if 400 <= r.status_code < 500:
            return r  # a bad request: the client gets the prefill instance's error
        if r.status_code != 200:  # the instance failed (e.g. its engine died): not the request
            logger.warning("prefill %s answered %s; decode computes the prompt", url, r.status_code)
            return None
        return r.json().get("kv_transfer_params")

    async def send_decode(url: str, body: dict, headers: dict, stream: bool) -> httpx.Response:
        """One retry when the connection broke before any answer (the instance closed a pooled
        connection as it was reused, or its link blipped): the request never ran there."""
        for attempt in (0, 1):
            req = client.build_request("POST", url, json=body, headers=headers)
            try:
                return await client.send(req, stream=stream)
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                if attempt:
                    raise
                logger.warning("decode %s: %s; retrying once", url, exc)
        raise AssertionError("unreachable")

    async def relay(path: str, request: Request):
        body = await request.json()
        headers = forward_headers(request)
        app.state.stats["requests"] += 1
        params = await prefill_params(path, body, headers)
        if isinstance(params, httpx.Response):
            return Response(
                params.content, status_code=params.status_code, media_type="application/json"
            )
        if params is None:
            app.state.stats["prefill_failures"] += 1
        d_body = dict(body, kv_transfer_params=params) if params else body
        url = next(next_d) + path
        try:
            r = await send_decode(url, d_body, headers, stream=bool(body.get("stream")))
        except httpx.HTTPError as exc:
            logger.warning("decode %s failed: %s", url, exc)
            return JSONResponse(
                {
                    "error": {
                        "message": f"decode instance {url} failed: {type(exc).__name__}",
                        "type": "BadGateway",
                        "code": 502,
                    }
                },
                status_code=502,
            )
        if not body.get("stream"):
            return Response(r.content, status_code=r.status_code, media_type="application/json")

        async def chunks():
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:
                await r.aclose()

        return StreamingResponse(
            chunks(),
            status_code=r.status_code,
            media_type=r.headers.get("content-type", "text/event-stream"),
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await relay("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request):
        r = await client.get(decode[0] + "/v1/models", headers=forward_headers(request))
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        bad = []
        for url in prefill + decode:
            try:
                ok = (await client.get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                bad.append(url)
        return JSONResponse({"unhealthy": bad}, status_code=503 if bad else 200)

    @app.get("/proxy/stats")
    async def stats():
        return app.state.stats

    return app


def add_parser(sub) -> None:
    p = sub.add_parser(
        "proxy",
        help="route requests to prefill then decode instances (P/D disaggregation)",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="prefill instances' base URLs, taken round robin (default: none, required)",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="decode instances' base URLs, taken round robin (default: none, required)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.set_defaults(func=cmd_proxy)


def cmd_proxy(args) -> int:
    import uvicorn

    app = build_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode])
    print(
        json.dumps(
            {
                "proxy": f"http://{args.host}:{args.port}",
                "prefill": args.prefill,
                "decode": args.decode,
            }
        )
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
