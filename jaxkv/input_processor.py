"""The input processor (vLLM V1's): tokenises and validates a request before the core sees it.

Every check that can be made without running the model is made here, so that a request that
reaches the scheduler can only fail in a step through a bug: prompts (empty, outside the
vocabulary, too long, truncation), token ids in the sampling parameters (stop / bias /
allowed / bad-word lists, within int32 and the vocabulary), ``top_k`` against the
vocabulary, logprob counts against ``max_logprobs`` (``-1``: the whole vocabulary, resolved
here), stop strings and bad words that need a tokenizer. It also resolves what the core
should not have to know: bad words to token ids, the model's extra EOS ids to stop ids,
pooling parameters to the engine's defaults. No jax, no engine state: ``LLMEngine`` owns
one and checks what depends on its state (duplicate ids, the step in flight).
"""

from __future__ import annotations

import dataclasses
import numbers

from jaxkv.core.request import Request
from jaxkv.core.stop_check import with_eos_stop_ids
from jaxkv.pooling_params import PoolingParams
from jaxkv.sampling_params import RequestOutputKind, SamplingParams, resolve_logprobs

#: What a pooling request's core ``Request`` carries: one greedy step's worth (the worker
#: returns its hidden states and never a token), output only when it finishes.
POOLING_SAMPLING = SamplingParams(
    max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
)


@dataclasses.dataclass
class ProcessedRequest:
    """A validated request as the front end registers it and the core queues it."""

    prompt: str | None  # the text, when the prompt was one
    prompt_token_ids: list[int]  # after truncation
    params: SamplingParams  # resolved (pooling requests: POOLING_SAMPLING)
    core_requests: list[Request]  # one per completion (n > 1: ids "i_<request_id>")
    pooling_params: PoolingParams | None = None  # resolved; None for generation


class InputProcessor:
    """Tokenises and validates requests for one engine.

    Args:
      config: the engine's ``EngineConfig`` (max_model_len, max_logprobs, EOS ids, pooler).
      model_config: the model's config (vocab_size, hidden_size).
      tokenizer: the model's tokenizer, or None (then prompts are token ids).
    """

    def __init__(self, config, model_config, tokenizer):
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id: the tokenizer's, else the model config's first (None: none).
        The other ids of ``config.eos_token_ids`` join each request's stop token ids."""
        eos = self.config.eos_token_ids
        return eos[0] if eos else None

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt: a string (encoded with the tokenizer), a
        list / array of token ids, or a dict with ``prompt`` or ``prompt_token_ids``."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(
                    f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
                )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"model {self.config.model_name!r} has no tokenizer: pass token-id lists, not strings"
                )
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):
            ids = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
            if bad:
                raise TypeError(f"prompt token ids must be ints, got {bad[:3]!r}")
            return None, [int(t) for t in ids]  # numpy integers too
        raise TypeError(
            f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def check_args(
        self, request_id, params, priority, cache_salt
    ) -> SamplingParams | PoolingParams:
        """The request's arguments' types (and the engine's ``runner``); ``params`` (None:
        ``SamplingParams()``)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise TypeError(
                f"params must be SamplingParams or PoolingParams, got {type(params).__name__}"
            )
        refused = {"pooling": SamplingParams, "generate": PoolingParams}.get(self.config.runner)
        if refused is not None and isinstance(params, refused):
            raise ValueError(
                f"this engine was built with runner={self.config.runner!r}: it takes no "
                f"{refused.__name__} requests (runner='auto' takes both)"
            )
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {cache_salt!r}")
        return params

    def process(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> ProcessedRequest:
        """Tokenises and validates one request and builds its core requests (``n > 1``: one
        per completion, ids ``f"{i}_{request_id}"`` and seeds ``seed + i``, as vLLM fans them
        out). ValueError / TypeError naming the field otherwise; nothing is registered."""
        params = self.check_args(request_id, params, priority, cache_salt)
        text, ids = self.tokenize(prompt)
        if isinstance(params, PoolingParams):
            ids, pp = self.process_pooling(request_id, ids, params)
            core = Request(
                request_id,
                ids,
                POOLING_SAMPLING,
                priority=priority,
                cache_salt=cache_salt,
                pooling_params=pp,
            )
            return ProcessedRequest(text, ids, POOLING_SAMPLING, [core], pp)
        ids, params = self.process_generation(request_id, ids, params)
        n = params.n
        requests = []
        for i in range(n):
            child_params = params
            if n > 1:  # seed + i taken mod 2**64 (the sampler's key is), so it stays in range
                child_params = dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else (params.seed + i) % (1 << 64)
                )
            requests.append(
                Request(
                    request_id if n == 1 else f"{i}_{request_id}",
                    ids,
                    child_params,
                    eos_token_id=self.eos_token_id,
                    priority=priority,
                    cache_salt=cache_salt,
                )
            )
        return ProcessedRequest(text, ids, params, requests)

    def process_generation(
        self, request_id: str, ids: list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams]:
        """The prompt (truncated, checked) and the parameters as the core takes them (logprob
        counts resolved, bad words encoded, extra EOS ids as stop ids: a copy); ValueError
        naming the field otherwise."""
        ids = self.checked_prompt(
            request_id, ids, params.truncate_prompt_tokens, self.config.max_model_len
        )
        # Everything the step would only fail on is refused here (SamplingParams has already
        # bounded each id and top_k by int32, so no numpy conversion can overflow later).
        self.check_vocab(request_id, "logit_bias", params.logit_bias or ())
        self.check_vocab(request_id, "allowed_token_ids", params.allowed_token_ids or ())
        self.check_vocab(request_id, "stop_token_ids", params.stop_token_ids)
        vocab = self.model_config.vocab_size
        if params.top_k > vocab:
            raise ValueError(
                f"request {request_id!r}: top_k={params.top_k} is larger than the "
                f"vocabulary size {vocab}"
            )
        try:  # logprobs=-1 -> vocab_size, then vLLM's max_logprobs cap
            params = resolve_logprobs(
                params, vocab_size=vocab, max_logprobs=self.config.max_logprobs
            )
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings {params.stop} need a tokenizer")
        params = self.with_bad_words_ids(request_id, params)
        params = with_eos_stop_ids(params, self.config.eos_token_ids[1:])  # every EOS id stops
        return ids, params

    def process_pooling(
        self, request_id: str, ids: list[int], params: PoolingParams
    ) -> tuple[list[int], PoolingParams]:
        """The prompt and the pooling parameters resolved with the engine's defaults."""
        pp = params.resolved(self.config.pooler_config, self.model_config.hidden_size)
        # The scheduler runs at most max_model_len - 1 positions, so a pooling prompt (whose
        # positions must all run) has one token less room than a generation prompt.
        return self.checked_prompt(
            request_id, ids, pp.truncate_prompt_tokens, self.config.max_model_len - 1
        ), pp

    def checked_prompt(
        self, request_id: str, ids: list[int], truncate: int | None, longest: int
    ) -> list[int]:
        """The prompt after ``truncate_prompt_tokens`` (vLLM's left truncation: the last k
        tokens, -1: ``max_model_len - 1``); ValueError when it is empty, has ids outside the
        vocabulary or is longer than ``longest``."""
        if truncate is not None:
            ids = ids[-(self.config.max_model_len - 1 if truncate == -1 else truncate) :]
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.check_vocab(request_id, "the prompt", ids)
        if len(ids) > longest:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(ids)} tokens is longer than {longest} "
                f"(max_model_len={self.config.max_model_len})"
            )
        return ids

    def check_vocab(self, request_id: str, what: str, token_ids) -> None:
        """ValueError naming the first ids of ``token_ids`` outside the model's vocabulary."""
        vocab = self.model_config.vocab_size
        outside = sorted({t for t in token_ids if not 0 <= t < vocab})
        if outside:
            raise ValueError(
                f"request {request_id!r}: {what} has token ids {outside[:5]} outside "
                f"the vocabulary [0, {vocab})"
            )

    def with_bad_words_ids(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """``params`` with ``bad_words`` encoded and appended to ``bad_words_token_ids`` (a copy:
        the caller's object is left alone); every id checked against the vocabulary.

        Each word is encoded as it stands (leading spaces stripped) and with one leading space;
        the second form is kept only when it starts with another token and has as many tokens
        (then it is the word's mid-sentence spelling, not the first form plus a space token).
        """
        words = list(params.bad_words_token_ids or [])
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError(
                    f"request {request_id!r}: bad_words {params.bad_words} need a tokenizer"
                )
            for word in params.bad_words:
                plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
                spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
                if not plain:
                    raise ValueError(
                        f"request {request_id!r}: bad word {word!r} encodes to no tokens"
                    )
                words.append(list(plain))
                if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                    words.append(list(spaced))
        self.check_vocab(request_id, "bad_words", [t for w in words for t in w])
        if not params.bad_words:
            return params
        return dataclasses.replace(params, bad_words_token_ids=words)
