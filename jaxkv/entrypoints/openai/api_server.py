"""The OpenAI-compatible server (vLLM's ``api_server``): a FastAPI app over ``AsyncLLM``.

``jaxkv serve MODEL`` runs :func:`run_server`; :func:`build_app` builds the app over an
engine (tests, embedding in another server). Routes: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/models``, ``/health``, ``/tokenize``,
``/detokenize``, ``/metrics``, ``/version``. With an API key every ``/v1`` route needs
``Authorization: Bearer KEY`` (401 otherwise). Errors are OpenAI's JSON shape."""

from __future__ import annotations

import hmac
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from jaxkv.engine.async_llm import AsyncLLM
from jaxkv.entrypoints.openai.metrics import PrometheusStatLogger
from jaxkv.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from jaxkv.entrypoints.openai.serving_chat import ServingChat, render_messages
from jaxkv.entrypoints.openai.serving_completion import ServingCompletion
from jaxkv.entrypoints.openai.serving_embedding import ServingEmbedding
from jaxkv.entrypoints.openai.serving_engine import (
    OpenAIError,
    Serving,
    from_engine_error,
    parse_body,
)


class APIKeyMiddleware:
    """401 on ``/v1`` routes without ``Authorization: Bearer KEY`` (plain ASGI: streamed
    responses and disconnects pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = OpenAIError(
                    401, "Unauthorized: a valid API key is needed (Authorization: Bearer KEY)"
                ).response()
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(
    engine: AsyncLLM, served_model_names: list[str], *, api_key: str | None = None
) -> FastAPI:
    app = FastAPI(title="jaxkv", docs_url=None, redoc_url=None, openapi_url=None)
    base = Serving(engine, served_model_names)
    completion = ServingCompletion(engine, served_model_names)
    chat = ServingChat(engine, served_model_names)
    embedding = ServingEmbedding(engine, served_model_names)
    stat_logger = PrometheusStatLogger(base.model_name)
    info = getattr(getattr(engine, "engine_core", None), "info", None) or {}
    stat_logger.start(num_compiles=int(info.get("num_compiles", 0)))  # the warm-up's programs
    engine.stat_loggers.append(stat_logger)
    created = int(time.time())

    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request, exc: OpenAIError):
        return exc.response()

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
        from importlib.metadata import PackageNotFoundError, version as pkg_version

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
        tok = base.tokenizer_or_400("/tokenize")
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = tok.encode(
                render_messages(tok, req.messages, req.add_generation_prompt),
                add_special_tokens=False,
            )
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        req = await parse_body(raw, DetokenizeRequest)
        base.check_model(req.model)
        tok = base.tokenizer_or_400("/detokenize")
        try:
            engine.input_processor.check_vocab("detokenize", "tokens", req.tokens)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "tokens") from exc
        return {"prompt": tok.decode(req.tokens)}

    return app


def run_server(
    engine: AsyncLLM,
    served_model_names: list[str],
    *,
    host: str,
    port: int,
    api_key: str | None = None,
    log_level: str = "info",
    ready_line: bool = True,
) -> None:
    """Serves until SIGINT / SIGTERM, then stops the engine core."""
    import uvicorn

    app = build_app(engine, served_model_names, api_key=api_key)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        engine.shutdown()
