"""``POST /v1/chat/completions`` (vLLM's ``OpenAIServingChat``): the model's chat template
renders the messages, ``n`` choices, streamed as ``chat.completion.chunk`` deltas (the first
of each choice carries the role) or answered whole, ``logprobs`` / ``top_logprobs`` in
OpenAI's chat shape, ``usage``."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxkv.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from jaxkv.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    Serving,
    from_engine_error,
    merge,
    now,
    parse_body,
    request_id,
    run_unless_disconnected,
    sse,
)

FIELDS = (
    "max_completion_tokens",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "top_logprobs",
    "logprobs",
    "min_tokens",
    "priority",
    "messages",
    "n",
)


def messages_chars(messages: list[ChatMessage]) -> int:
    """Characters of the messages' roles and texts: the rendered prompt has at least as many."""
    total = 0
    for m in messages:
        total += len(m.role)
        if isinstance(m.content, str):
            total += len(m.content)
        elif isinstance(m.content, list):
            total += sum(len(p["text"]) for p in m.content if isinstance(p.get("text"), str))
    return total


async def encode_messages(
    serving: Serving,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    field: str = "messages",
) -> list[int]:
    """The messages' prompt ids (the template rendered, then encoded), refused from their
    count and length before any of that runs; large ones render and encode in a worker."""
    serving.limits.check_messages(len(messages))
    chars = messages_chars(messages)
    cap = serving.limits.max_prompt_chars
    if cap is not None and chars > cap:
        raise OpenAIError(
            400,
            f"{field} have {chars} characters: more than can fit in max_model_len="
            f"{serving.engine.config.max_model_len} tokens (at most {cap} characters, "
            "--max-prompt-chars)",
            field,
        )
    tok = serving.tokenizer_or_400("chat")
    prompt = await serving.offload(chars, render_messages, tok, messages, add_generation_prompt)
    return await serving.encode(prompt, add_special_tokens=False)


def render_messages(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
    """The chat template applied to the messages (text parts of list contents joined)."""
    plain = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(
                        400,
                        f"messages.{i}.content: only text parts are supported, got "
                        f"{part.get('type')!r}",
                        f"messages.{i}.content",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        plain.append({"role": m.role, "content": content or ""})
    if tokenizer.chat_template is None:
        raise OpenAIError(400, "the model has no chat template: use /v1/completions", "messages")
    try:
        return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
    except (ValueError, TypeError) as exc:  # the template raised (e.g. an unknown role)
        raise OpenAIError(
            400, f"the chat template refused the messages: {exc}", "messages"
        ) from exc


class ServingChat(Serving):
    async def create(self, raw: Request):
        req = await parse_body(raw, ChatCompletionRequest)
        model = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        self.limits.check_n(req.n)
        self.limits.check_sequences(1, req.n, "messages")
        self.limits.check_stop(req.stop)
        self.limits.check_logit_bias(req.logit_bias)
        prompt_ids = await encode_messages(self, req.messages, req.add_generation_prompt)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        asked = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        rid = request_id("chatcmpl")
        try:
            max_tokens = self.max_tokens_for(asked, len(prompt_ids), field)
            sp = req.sampling_params(
                max_tokens,
                logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                prompt_logprobs=None,
                stream=req.stream,
            )
            stream = await self.engine.add_request(rid, prompt_ids, sp, priority=req.priority)
        except BaseException as exc:
            raise from_engine_error(exc, FIELDS) from exc
        state = _State(self, req, rid, model)
        if req.stream:
            return StreamingResponse(
                self.aborting(state.stream(stream), [rid]), media_type="text/event-stream"
            )
        try:
            return JSONResponse(await run_unless_disconnected(state.full(stream), raw))
        finally:
            await self.abort_all([rid])


class _State:
    def __init__(self, serving: Serving, req: ChatCompletionRequest, rid: str, model: str):
        self.s, self.req, self.rid, self.model = serving, req, rid, model
        self.created = now()
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def _usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def _logprobs(self, c) -> dict | None:
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for token_id, entries in zip(c.token_ids, c.logprobs or []):
            chosen = entries[token_id]
            name = self.s.token_str(token_id, chosen.decoded_token)
            top = sorted(entries.items(), key=lambda kv: kv[1].rank)[:k]
            content.append(
                {
                    "token": name,
                    "logprob": chosen.logprob,
                    "bytes": list(name.encode()),
                    "top_logprobs": [
                        {
                            "token": (t := self.s.token_str(i, e.decoded_token)),
                            "logprob": e.logprob,
                            "bytes": list(t.encode()),
                        }
                        for i, e in top
                    ],
                }
            )
        return {"content": content}

    async def full(self, stream) -> dict:
        choices = []
        kv_params = None
        async for _, out in merge([stream]):
            if not out.finished:
                continue
            kv_params = out.kv_transfer_params
            self.prompt_tokens = len(out.prompt_token_ids)
            for c in out.outputs:
                self.completion_tokens += len(c.token_ids)
                choices.append(
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": self._logprobs(c),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        choices.sort(key=lambda ch: ch["index"])
        return {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
            "kv_transfer_params": kv_params,
        }

    def _chunk(self, choices: list, **extra) -> str:
        return sse(
            {
                "id": self.rid,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **extra,
            }
        )

    async def stream(self, stream):
        try:
            for i in range(self.req.n):  # vLLM's first chunk of each choice: the role
                yield self._chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            async for _, out in merge([stream]):
                self.prompt_tokens = len(out.prompt_token_ids)
                for c in out.outputs:
                    self.completion_tokens += len(c.token_ids)
                    if not (c.text or c.finish_reason or (self.req.logprobs and c.token_ids)):
                        continue  # nothing new yet (an incomplete UTF-8 sequence)
                    delta = {"content": c.text} if c.text else {}
                    yield self._chunk(
                        [
                            {
                                "index": c.index,
                                "delta": delta,
                                "logprobs": self._logprobs(c),
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                            }
                        ]
                    )
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                yield self._chunk([], usage=self._usage())
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            yield sse(from_engine_error(exc).body())
        yield SSE_DONE
