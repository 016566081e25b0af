"""The OpenAI-compatible server (vLLM's ``api_server``): a FastAPI app over ``AsyncLLM``.

``jaxkv serve MODEL`` runs :func:`run_server`; :func:`build_app` builds the app over an
engine (tests, embedding in another server). Routes: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/models``, ``/health``, ``/tokenize``,
``/detokenize``, ``/metrics``, ``/version``. With an API key every ``/v1`` route needs
``Authorization: Bearer KEY`` (401 otherwise). Errors are OpenAI's JSON shape. Requests pass
``guard.RequestGuard`` first (hosts, key, JSON only, body limits) and ``limits.ServerLimits``
before any expensive work; docs/serving.md lists every limit."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from jaxkv.engine.async_llm import AsyncLLM
from jaxkv.entrypoints.openai.guard import RequestGuard
from jaxkv.entrypoints.openai.http_server import HTTPOptions
from jaxkv.entrypoints.openai.limits import ServerLimits
from jaxkv.entrypoints.openai.metrics import PrometheusStatLogger
from jaxkv.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from jaxkv.entrypoints.openai.serving_chat import ServingChat, encode_messages
from jaxkv.entrypoints.openai.serving_completion import ServingCompletion
from jaxkv.entrypoints.openai.serving_embedding import ServingEmbedding
from jaxkv.entrypoints.openai.serving_engine import (
    OpenAIError,
    Serving,
    from_engine_error,
    parse_body,
)

#: Worker threads for tokenising, detokenising and chat templates of large inputs.
NUM_WORKERS = 2


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    *,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    http: HTTPOptions | None = None,
):
    """The app behind its ``RequestGuard`` (an ASGI app; ``.app`` is the FastAPI one).

    Args:
      limits: what one request may ask for (default ``ServerLimits()``).
      http: the allowed hosts and the body-read timeout (default: any host).
    """
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty: an empty key would refuse every /v1 request")
    limits = (limits or ServerLimits()).resolved(engine.tokenizer, engine.config.max_model_len)
    http = http or HTTPOptions()
    app = FastAPI(title="jaxkv", docs_url=None, redoc_url=None, openapi_url=None)
    pool = ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="jaxkv-tokenize")
    args = (engine, served_model_names, limits, pool)
    base, completion, chat, embedding = (
        Serving(*args),
        ServingCompletion(*args),
        ServingChat(*args),
        ServingEmbedding(*args),
    )
    stat_logger = PrometheusStatLogger(base.model_name)
    info = getattr(getattr(engine, "engine_core", None), "info", None) or {}
    stat_logger.start(num_compiles=int(info.get("num_compiles", 0)))  # the warm-up's programs
    engine.stat_loggers.append(stat_logger)
    created = int(time.time())

    @app.exception_handler(OpenAIError)
    async def openai_error(_request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(ClientDisconnect)
    async def client_left(_request, _exc):  # nobody reads it; no traceback in the log
        return OpenAIError(499, "client disconnected").response()

    @app.exception_handler(Exception)
    async def any_error(_request, exc: Exception):
        return from_engine_error(exc).response()

    @app.post("/v1/completions")
    async def create_completion(raw: Request):
        return await completion.create(raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request):
        return await chat.create(raw)

    @app.post("/v1/embeddings")
    async def create_embedding(raw: Request):
        return await embedding.create(raw)

    @app.get("/v1/models")
    async def show_models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "jaxkv",
                    "root": engine.config.model,
                    "max_model_len": engine.config.max_model_len,
                }
                for name in served_model_names
            ],
        }

    @app.get("/health")
    async def health():
        try:
            engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure is "not healthy"
            return from_engine_error(exc).response()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as pkg_version

        try:
            return {"version": pkg_version("jaxkv")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/metrics")
    async def metrics():
        return Response(stat_logger.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        req = await parse_body(raw, TokenizeRequest)
        base.check_model(req.model)
        base.tokenizer_or_400("/tokenize")
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = await encode_messages(base, req.messages, req.add_generation_prompt)
        else:
            base.limits.check_prompt_length(req.prompt, engine.config.max_model_len)
            ids = await base.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        req = await parse_body(raw, DetokenizeRequest)
        base.check_model(req.model)
        base.tokenizer_or_400("/detokenize")
        base.limits.check_prompt_length(req.tokens, engine.config.max_model_len, "tokens")
        try:
            engine.input_processor.check_vocab("detokenize", "tokens", req.tokens)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "tokens") from exc
        return {"prompt": await base.decode(req.tokens)}

    return RequestGuard(
        app,
        allowed_hosts=http.allowed_hosts,
        api_key=api_key,
        max_body_bytes=limits.max_body_bytes,
        body_timeout_s=http.timeout_body_read_s,
    )


def run_server(
    engine: AsyncLLM,
    served_model_names: list[str],
    *,
    host: str,
    port: int,
    api_key: str | None = None,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    http: HTTPOptions | None = None,
) -> int:
    """Serves until SIGINT / SIGTERM (exit code 0) or the engine core's death (1, unless
    ``http.keep_serving_on_core_death``), then ends the open requests, closes the connections
    and shuts the engine core down (joined, its IPC directory removed)."""
    import uvicorn

    from jaxkv.entrypoints.openai.http_server import ServeServer, guarded_h11_protocol

    http = http or HTTPOptions()
    app = build_app(engine, served_model_names, api_key=api_key, limits=limits, http=http)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=http.timeout_keep_alive_s,
        http=guarded_h11_protocol(http.timeout_header_read_s, http.max_connections),
        lifespan="off",
    )

    def end_requests():
        engine.fail_all_requests(OpenAIError(503, "the server is shutting down"))

    server = ServeServer(
        config,
        on_stop=end_requests,
        core_proc=engine.engine_core.proc,
        keep_serving_on_core_death=http.keep_serving_on_core_death,
    )
    try:
        server.run()
    finally:
        engine.shutdown()
    return server.exit_code
