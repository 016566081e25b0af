"""``POST /v1/completions`` (vLLM's ``OpenAIServingCompletion``): one request per prompt,
``n`` completions each (choice index ``prompt_index * n + i``), streamed as SSE chunks or
answered whole, ``echo``, ``logprobs`` (OpenAI's legacy shape) and ``usage``."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxkv.entrypoints.openai.protocol import CompletionRequest
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
    "logprobs",
    "min_tokens",
    "priority",
    "prompt",
    "n",
)


class ServingCompletion(Serving):
    async def create(self, raw: Request):
        req = await parse_body(raw, CompletionRequest)
        model = self.check_model(req.model)
        limits = self.limits  # every limit before any prompt is tokenised
        limits.check_n(req.n, req.best_of)
        if req.suffix is not None:
            raise OpenAIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError(
                400, f"best_of={req.best_of} is not supported (only best_of == n)", "best_of"
            )
        prompts = self.prompts_of(req.prompt)
        limits.check_sequences(len(prompts), req.n, "prompt")
        limits.check_stop(req.stop)
        limits.check_logit_bias(req.logit_bias)
        for prompt in prompts:  # every prompt's length, before any is tokenised
            limits.check_prompt_length(prompt, self.engine.config.max_model_len)
        rid = request_id("cmpl")
        streams, rids = [], []
        try:
            for i, prompt in enumerate(prompts):
                ids = await self.encode(prompt) if isinstance(prompt, str) else prompt
                max_tokens = self.max_tokens_for(req.max_tokens, len(ids), "max_tokens")
                sp = req.sampling_params(
                    max_tokens,
                    logprobs=req.logprobs,
                    prompt_logprobs=req.logprobs if req.echo else None,
                    stream=req.stream,
                )
                streams.append(
                    await self.engine.add_request(f"{rid}-{i}", ids, sp, priority=req.priority)
                )
                rids.append(f"{rid}-{i}")
                await asyncio.sleep(0)  # a large batch lets other requests in between its prompts
        except BaseException as exc:  # every prompt is valid or none runs
            await self.abort_all(rids)
            raise from_engine_error(exc, FIELDS) from exc
        state = _State(self, req, rid, model, prompts)
        if req.stream:
            return StreamingResponse(
                self.aborting(state.stream(streams), rids), media_type="text/event-stream"
            )
        try:
            return JSONResponse(await run_unless_disconnected(state.full(streams), raw))
        finally:
            await self.abort_all(rids)


class _State:
    def __init__(
        self, serving: Serving, req: CompletionRequest, rid: str, model: str, prompts: list
    ):
        self.s, self.req, self.rid, self.model = serving, req, rid, model
        self.prompts = prompts  # as sent: the engine got token ids (tokenised off the event loop)
        self.created = now()
        self.prompt_tokens = [0] * len(prompts)
        self.completion_tokens = 0
        self.offsets: dict[int, int] = {}  # choice -> text offset (logprobs' text_offset)

    def _usage(self) -> dict:
        p = sum(self.prompt_tokens)
        return {
            "prompt_tokens": p,
            "completion_tokens": self.completion_tokens,
            "total_tokens": p + self.completion_tokens,
        }

    def _echo(self, i: int, out) -> tuple[str, list | None]:
        """Prompt ``i``'s text and, with logprobs, its positions (the first has none)."""
        tok = self.s.engine.tokenizer
        text = (
            self.prompts[i]
            if isinstance(self.prompts[i], str)
            else (tok.decode(out.prompt_token_ids) if tok else "")
        )
        if self.req.logprobs is None:
            return text, None
        plps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return text, list(zip(out.prompt_token_ids, plps))

    def _logprobs(self, index: int, positions: list, echo_text: str = "") -> dict:
        """OpenAI's completion logprobs for ``positions`` (token id, {id: Logprob} or None)."""
        tok = self.s.engine.tokenizer
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self.offsets.get(index, 0)
        for token_id, entries in positions:
            chosen = entries.get(token_id) if entries else None
            name = self.s.token_str(
                token_id,
                chosen.decoded_token if chosen else (tok.decode([token_id]) if tok else None),
            )
            lp["tokens"].append(name)
            lp["token_logprobs"].append(chosen.logprob if chosen else None)
            lp["top_logprobs"].append(
                {self.s.token_str(t, e.decoded_token): e.logprob for t, e in entries.items()}
                if entries
                else None
            )
            lp["text_offset"].append(offset)
            offset += len(name)
        self.offsets[index] = offset
        return lp

    def _choice(self, i: int, out, c, first: bool) -> dict:
        index = i * self.req.n + c.index
        text, lp = c.text, None
        if self.req.echo and first:
            echo_text, echo_positions = self._echo(i, out)
            text = echo_text + text
            if echo_positions is not None:
                lp = self._logprobs(index, echo_positions)
        if self.req.logprobs is not None:
            gen = self._logprobs(index, list(zip(c.token_ids, c.logprobs or [])))
            lp = gen if lp is None else {k: lp[k] + gen[k] for k in lp}
        return {
            "index": index,
            "text": text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    async def full(self, streams) -> dict:
        choices = []
        kv_params = None
        async for i, out in merge(streams):
            if not out.finished:
                continue
            kv_params = out.kv_transfer_params or kv_params
            self.prompt_tokens[i] = len(out.prompt_token_ids)
            for c in out.outputs:
                self.completion_tokens += len(c.token_ids)
                choices.append(self._choice(i, out, c, first=True))
        choices.sort(key=lambda ch: ch["index"])
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
            "kv_transfer_params": kv_params,
        }

    async def stream(self, streams):
        seen: set[int] = set()
        try:
            async for i, out in merge(streams):
                self.prompt_tokens[i] = len(out.prompt_token_ids)
                for c in out.outputs:
                    index = i * self.req.n + c.index
                    self.completion_tokens += len(c.token_ids)
                    choice = self._choice(i, out, c, first=index not in seen)
                    seen.add(index)
                    if not (c.token_ids or choice["text"] or choice["finish_reason"]):
                        continue  # no new token (a chunk per token: text-less models stream too)
                    yield sse(
                        {
                            "id": self.rid,
                            "object": "text_completion",
                            "created": self.created,
                            "model": self.model,
                            "choices": [choice],
                        }
                    )
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                yield sse(
                    {
                        "id": self.rid,
                        "object": "text_completion",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": self._usage(),
                    }
                )
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            yield sse(from_engine_error(exc).body())
        yield SSE_DONE
