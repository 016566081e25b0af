"""OpenAI's request bodies as pydantic models (vLLM's ``protocol.py``), and their conversion to
``SamplingParams`` / ``PoolingParams``.

The models are strict (a string is not a number, ``1`` is not ``true``, ``1.5`` is not an
int), so every wrong type is a 400 naming the field. Unknown fields are ignored, as OpenAI's
and vLLM's servers do. Values are checked by ``SamplingParams`` and the engine's input
processor, whose messages name the field; the server turns them into 400s. Lists stop at
their first bad item (``FailFast``): a million bad numbers cost one error, not a million.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, FailFast, Field

from jaxkv.pooling_params import PoolingParams
from jaxkv.sampling_params import RequestOutputKind, SamplingParams


class _FailFast(FailFast):
    """pydantic's ``FailFast``, hashable (``typing.Union`` of Python 3.11 hashes its members)."""

    __hash__ = object.__hash__


Ids = Annotated[list[int], _FailFast()]
Strs = Annotated[list[str], _FailFast()]
#: A prompt (or embedding input): a text, texts, token ids, or token-id lists.
Prompt = str | Strs | Ids | Annotated[list[Ids], _FailFast()]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class _SamplingFields(OpenAIBaseModel):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | Strs | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Ids | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # vLLM's P/D field: the KV connector's parameters (e.g. {"do_remote_decode": true} to a
    # prefill instance; a prefill response's kv_transfer_params to a decode instance)
    kv_transfer_params: dict | None = None

    def sampling_params(
        self,
        max_tokens: int | None,
        *,
        logprobs: int | None,
        prompt_logprobs: int | None,
        stream: bool,
    ) -> SamplingParams:
        """``SamplingParams`` (ValueError / TypeError naming the field on a bad value)."""
        bias = None
        if self.logit_bias is not None:
            from jaxkv.entrypoints.openai.limits import parse_token_id_key

            bias = {parse_token_id_key(k): v for k, v in self.logit_bias.items()}
        kw = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
            if getattr(self, name) is not None
        }
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            stop=self.stop,
            seed=self.seed,
            logit_bias=bias,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            extra_args={"kv_transfer_params": self.kv_transfer_params}
            if self.kv_transfer_params is not None
            else None,
            **kw,
        )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(OpenAIBaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | Annotated[list[dict], _FailFast()] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], _FailFast()] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class EmbeddingRequest(OpenAIBaseModel):
    """``POST /v1/embeddings``."""

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    priority: int = 0

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(
            task="embed",
            dimensions=self.dimensions,
            normalize=self.normalize,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize``: ``prompt`` or chat ``messages`` (vLLM's)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], _FailFast()] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: Ids
