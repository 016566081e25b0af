"""``POST /v1/embeddings`` (vLLM's ``OpenAIServingEmbedding``): one pooling request per input,
vectors as floats or base64 (little-endian float32, what the ``openai`` client asks for by
default), ``usage``."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from jaxkv.entrypoints.openai.protocol import EmbeddingRequest
from jaxkv.entrypoints.openai.serving_engine import (
    Serving,
    from_engine_error,
    merge,
    parse_body,
    request_id,
    run_unless_disconnected,
)

FIELDS = ("dimensions", "truncate_prompt_tokens", "normalize", "priority", "input")


class ServingEmbedding(Serving):
    async def create(self, raw: Request):
        req = await parse_body(raw, EmbeddingRequest)
        model = self.check_model(req.model)
        inputs = self.prompts_of(req.input, "input")
        self.limits.check_sequences(len(inputs), 1, "input")
        max_len = self.engine.config.max_model_len
        for prompt in inputs:  # truncated prompts may be longer in tokens, never in characters
            if req.truncate_prompt_tokens is None or isinstance(prompt, str):
                self.limits.check_prompt_length(prompt, max_len, "input")
        rid = request_id("embd")
        streams, rids = [], []
        try:
            pp = req.pooling_params()
            for i, prompt in enumerate(inputs):
                ids = await self.encode(prompt) if isinstance(prompt, str) else prompt
                streams.append(
                    await self.engine.add_request(f"{rid}-{i}", ids, pp, priority=req.priority)
                )
                rids.append(f"{rid}-{i}")
                await asyncio.sleep(0)
        except BaseException as exc:
            await self.abort_all(rids)
            raise from_engine_error(exc, FIELDS) from exc

        async def collect() -> dict:
            data, tokens = [None] * len(inputs), 0
            async for i, out in merge(streams):
                vec = np.asarray(out.outputs.data, dtype="<f4")
                tokens += len(out.prompt_token_ids)
                emb = (
                    base64.b64encode(vec.tobytes()).decode()
                    if req.encoding_format == "base64"
                    else vec.tolist()
                )
                data[i] = {"object": "embedding", "index": i, "embedding": emb}
            return {
                "id": rid,
                "object": "list",
                "model": model,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }

        try:
            return JSONResponse(await run_unless_disconnected(collect(), raw))
        except BaseException as exc:
            raise from_engine_error(exc, FIELDS) from exc
        finally:
            await self.abort_all(rids)
