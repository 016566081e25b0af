"""What the endpoints share (vLLM's ``OpenAIServing``): the model check, OpenAI's error shape,
prompt handling, merging the streams of several requests, disconnect watching, SSE framing.

Tokenising, detokenising and chat templates of inputs longer than ``INLINE_CHARS`` run in the
server's worker threads (``Serving.pool``; the tokenizers library releases the GIL), so the
event loop keeps answering ``/health`` and feeding other streams meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor

from fastapi import Request
from pydantic import ValidationError

from jaxkv.core.errors import EngineStepError
from jaxkv.engine.async_llm import AsyncLLM, EngineDeadError
from jaxkv.entrypoints.openai.errors import OpenAIError

#: Texts (or token lists) shorter than this are tokenised / detokenised on the event loop: a
#: worker-thread round trip costs more than the work (~0.1 ms for 2,000 characters).
INLINE_CHARS = 4096

#: Validation errors quoted in one message; each error's input is an excerpt.
MAX_QUOTED_ERRORS = 4


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """A 400 naming every bad field (pydantic's location, e.g. ``messages.0.role``)."""
    parts, first = [], None
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    for err in errors[:MAX_QUOTED_ERRORS]:
        loc = ".".join(str(x) for x in err["loc"] if x != "body") or "body"
        first = first or loc
        parts.append(f"{loc if len(loc) <= 80 else loc[:80] + '...'}: {err['msg']}")
    if len(errors) > MAX_QUOTED_ERRORS:
        parts.append(f"and {len(errors) - MAX_QUOTED_ERRORS} more errors")
    return OpenAIError(400, "; ".join(parts), first)


def from_engine_error(exc: BaseException, fields: tuple[str, ...] = ()) -> OpenAIError:
    """ValueError / TypeError (bad parameters, raised by SamplingParams or the input
    processor, naming the field) -> 400; a dead engine -> 503; a failed step -> 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"the engine is not running: {exc}")
    if isinstance(exc, EngineStepError):
        return OpenAIError(500, str(exc))
    if isinstance(exc, (ValueError, TypeError)):
        message = str(exc)
        param = next((f for f in fields if f in message), None)
        return OpenAIError(400, message, param)
    return OpenAIError(500, f"{type(exc).__name__}: {exc}")


async def parse_body(raw: Request, model_cls):
    """The body validated as ``model_cls`` (400 naming the fields otherwise). The body is
    already bounded (``guard.RequestGuard``) and the models fail fast on long lists."""
    body = await raw.body()
    try:
        return model_cls.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise from_validation_error(exc) from None


class Serving:
    """The engine, the served model names, the request limits, the worker pool and the
    helpers every endpoint uses."""

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        limits=None,
        pool: Executor | None = None,
    ):
        from jaxkv.entrypoints.openai.limits import ServerLimits

        self.engine = engine
        self.served_model_names = served_model_names
        self.limits = (
            limits
            if limits is not None
            else ServerLimits().resolved(engine.tokenizer, engine.config.max_model_len)
        )
        self.pool = pool  # None: the event loop's default executor

    async def offload(self, size: int, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)``, in a worker thread when ``size`` (characters or tokens)
        is at least ``INLINE_CHARS``."""
        if size < INLINE_CHARS:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, functools.partial(fn, *args, **kwargs)
        )

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok = self.tokenizer_or_400("a text prompt")
        return await self.offload(
            len(text), tok.encode, text, add_special_tokens=add_special_tokens
        )

    async def decode(self, ids: list[int]) -> str:
        return await self.offload(len(ids), self.engine.tokenizer.decode, ids)

    async def prompt_ids(self, prompt, field: str = "prompt") -> list[int]:
        """A prompt's token ids, refused from its length first when it cannot fit."""
        self.limits.check_prompt_length(prompt, self.engine.config.max_model_len, field)
        return await self.encode(prompt) if isinstance(prompt, str) else prompt

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.served_model_names:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model")
        return self.model_name

    def tokenizer_or_400(self, what: str):
        tok = self.engine.tokenizer
        if tok is None:
            raise OpenAIError(
                400,
                f"model {self.model_name!r} has no tokenizer: {what} needs one "
                "(send prompts as token-id lists)",
            )
        return tok

    @staticmethod
    def prompts_of(prompt, field: str = "prompt") -> list:
        """One prompt or a batch (strings or token-id lists) -> a non-empty list."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise OpenAIError(400, f"{field} must not be empty", field)
        return list(prompt)

    def max_tokens_for(self, asked: int | None, prompt_len: int, field: str) -> int:
        """vLLM's rule: ``None`` -> what fits in max_model_len; more than fits -> 400."""
        room = self.engine.config.max_model_len - prompt_len
        if asked is None:
            if room < 1:
                raise OpenAIError(
                    400,
                    f"the prompt has {prompt_len} tokens: no room to generate within "
                    f"max_model_len={self.engine.config.max_model_len}",
                    "prompt",
                )
            return room
        if isinstance(asked, int) and asked >= 1 and asked > room:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.engine.config.max_model_len} "
                f"tokens. However, you requested {prompt_len + asked} tokens ({prompt_len} "
                f"in the prompt, {asked} in {field}). Please reduce the length.",
                field,
            )
        return asked

    async def abort_all(self, request_ids: list[str]) -> None:
        """Aborts requests (finished ones are ignored): every exit path of an endpoint calls
        this, so a request whose stream was never read cannot keep running."""
        for rid in request_ids:
            await self.engine.abort(rid)

    async def aborting(
        self, chunks: AsyncIterator[str], request_ids: list[str]
    ) -> AsyncIterator[str]:
        """A streamed body that aborts its requests however it ends (a disconnect included)."""
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()
            await self.abort_all(request_ids)

    def token_str(self, token_id: int, decoded: str | None) -> str:
        if decoded is not None:
            return decoded
        return f"token_id:{token_id}"


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


async def merge(generators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """``(i, item)`` from several async generators as they come; closes all of them when
    the consumer stops early (cancelled: their requests are aborted)."""
    if len(generators) == 1:
        async for item in generators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for item in gen:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in generators:
            await g.aclose()


async def run_unless_disconnected(coro, raw: Request):
    """Awaits ``coro`` unless the client disconnects first (then it is cancelled, which
    aborts its requests, and 499 is the answer nobody reads)."""
    task = asyncio.ensure_future(coro)

    async def disconnected():
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise OpenAIError(499, "client disconnected")
    return task.result()


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
