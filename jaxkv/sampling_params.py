"""Sampling parameters for one request, with vLLM's names and defaults (no jax import).

The engine reads these; the host core (`jaxkv.core`) reads ``max_tokens``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids`` and ``prompt_logprobs``. Nothing downstream mutates them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers

#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5

#: The worker holds token ids, ``top_k`` and counts as int32: larger values are refused here,
#: before any numpy conversion could overflow.
INT32_MAX = 2**31 - 1

#: The largest finite float32 (temperature and repetition_penalty become float32 on the device).
FLOAT32_MAX = 3.4028234663852886e38

#: Seeds must fit a 64-bit generator seed, signed or unsigned (torch's ``manual_seed`` range):
#: the sampler keys on ``seed mod 2**64``, so a wider seed would silently share a key.
SEED_RANGE = (-(2**63), 2**64)


class SamplingType(enum.IntEnum):
    """How the sampler picks a token."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.IntEnum):
    """What ``LLMEngine.step`` returns for a request (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = 0  # everything generated so far (n > 1: the changed completions, each whole)
    DELTA = 1  # only what is new since the previous output (n > 1: changed completions only)
    FINAL_ONLY = 2  # one output, when the request finishes (``LLM.generate`` uses this)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value) -> bool:  # numpy integers too (token ids often come from arrays)
    return (
        isinstance(value, numbers.Integral) and not _is_bool(value) and 0 <= int(value) <= INT32_MAX
    )


def _token_ids(name: str, values) -> list[int]:
    """``values`` as a list of Python ints; ValueError naming ``name`` and the first bad ids
    unless each is an int in [0, 2**31 - 1] (the vocabulary is checked by the engine)."""
    values = list(values)
    bad = [t for t in values if not _is_token_id(t)]
    if bad:
        raise ValueError(f"{name} must hold token ids (ints in [0, {INT32_MAX}]), got {bad[:5]!r}")
    return [int(t) for t in values]


def _is_bool(value) -> bool:  # numpy's bool_ scalar too (duck-typed: no numpy import here)
    return isinstance(value, bool) or (
        getattr(getattr(value, "dtype", None), "kind", None) == "b"
        and getattr(value, "shape", None) == ()
    )


def _is_number(value) -> bool:  # numpy scalars included
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass
class SamplingParams:
    """Sampling parameters (vLLM V1 names and defaults).

    Normalisation done in ``__post_init__`` (so consumers see one form):
      * ``stop``: ``None`` or a string becomes a list of strings.
      * ``stop_token_ids``: ``None`` becomes ``[]``.
      * ``top_k``: ``-1`` (vLLM's older "disabled") becomes ``0`` (disabled).
      * greedy (``temperature < 1e-5``): ``top_p``, ``top_k``, ``min_p`` are reset to their
        disabled values, as vLLM does.

    Attributes:
        n: Number of completions per prompt (>= 1; identical when greedy).
        temperature: Softmax temperature (>= 0); below 1e-5 means greedy.
        top_p: Nucleus mass in (0, 1].
        top_k: Keep the k most likely tokens; 0 (or -1) disables. At most 2**31 - 1 here;
            the engine refuses a ``top_k`` above the vocabulary size.
        min_p: Minimum probability relative to the most likely token, in [0, 1].
        seed: Per-request generator seed in [-2**63, 2**64), or None.
        stop: Stop strings (matched by the detokenizer, not the core; need ``detokenize``).
        stop_token_ids: Token ids that stop generation (checked by the scheduler). The
            engine adds the model's other EOS ids to them unless ``ignore_eos`` (vLLM's
            generation-config EOS ids).
        ignore_eos: Keep generating after EOS.
        max_tokens: Maximum number of generated tokens (>= 1), or None for "until
            max_model_len".
        min_tokens: EOS and stop token ids are ignored before this many tokens.
        logprobs: Number of top logprobs per generated token (None: none; -1: whole vocab).
            The engine resolves -1 to the vocabulary size and refuses counts above its
            ``max_logprobs`` (vLLM V1's rule).
        prompt_logprobs: Number of top logprobs per prompt token (None: none; -1: whole
            vocab, capped as ``logprobs``). Requests that ask for them bypass prefix-cache hits.
        presence_penalty: In [-2, 2].
        frequency_penalty: In [-2, 2].
        repetition_penalty: > 0; 1 disables.
        include_stop_str_in_output: Keep the matched stop string in the text.
        skip_special_tokens: Drop special tokens when detokenizing.
        spaces_between_special_tokens: Detokenizer option.
        detokenize: Whether the engine detokenizes the output.
        output_kind: ``RequestOutputKind`` of the outputs ``LLMEngine.step`` returns.
        logit_bias: ``{token id: bias}`` added to the logits before penalties and sampling
            (finite biases, clamped to [-100, 100], as OpenAI's ``logit_bias``).
        allowed_token_ids: Only these token ids can be sampled (non-empty), or None.
        bad_words: Words that must not be generated (vLLM's ``bad_words``). The engine encodes
            each (without special tokens) as it stands and with a leading space, keeping the
            second form only when it is a different word of the same length, as vLLM does; a
            word's last token is banned whenever the tokens generated just before it equal the
            rest of the word. Needs a tokenizer. A string is taken as one word.
        truncate_prompt_tokens: Keep only the prompt's last k tokens (k >= 1; vLLM's left
            truncation); -1 keeps the most that fit, ``max_model_len - 1`` (one position is
            left for the output; vLLM keeps ``max_model_len``); None keeps the whole prompt.
        bad_words_token_ids: The same rule on token-id sequences, for models without a
            tokenizer (a jaxkv extension; vLLM derives these from ``bad_words`` only). The
            engine appends the encoded ``bad_words`` to these.
        extra_args: Free-form arguments for extensions (vLLM's); the engine reads
            ``extra_args["kv_transfer_params"]`` (a dict) for the KV connector.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | str | None = None
    truncate_prompt_tokens: int | None = None
    bad_words_token_ids: list[list[int]] | None = None
    extra_args: dict | None = None

    def __post_init__(self):
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if not _is_number(value):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if value != value:
                raise ValueError(f"{name} must not be NaN")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
        ):
            value = getattr(self, name)
            if not _is_bool(value):  # "no" would be truthy
                raise TypeError(f"{name} must be a bool, got {value!r}")
            setattr(self, name, bool(value))
        for name, one_str_ok in (
            ("stop", True),
            ("stop_token_ids", False),
            ("allowed_token_ids", False),
            ("bad_words", True),
        ):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, (list, tuple)) or (one_str_ok and isinstance(value, str))
            ):
                raise TypeError(
                    f"{name} must be a list{' or a str' if one_str_ok else ''}, got {value!r}"
                )
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        for name in ("temperature", "repetition_penalty"):  # float32 on the device
            if getattr(self, name) > FLOAT32_MAX:
                raise ValueError(
                    f"{name} must be at most {FLOAT32_MAX:.4g} (float32), "
                    f"got {getattr(self, name)!r}"
                )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(
                f"top_k must be 0 or -1 (disabled) or an int in [1, {INT32_MAX}], "
                f"got {self.top_k!r}"
            )
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 (or None), got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise ValueError(f"{name} must be None, -1 (whole vocab) or >= 0, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if isinstance(self.output_kind, bool) or self.output_kind not in tuple(RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise TypeError(f"extra_args must be a dict or None, got {self.extra_args!r}")
            params = self.extra_args.get("kv_transfer_params")
            if params is not None and not isinstance(params, dict):
                raise TypeError(f"extra_args['kv_transfer_params'] must be a dict, got {params!r}")

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must contain non-empty strings, got {self.stop!r}")
        if self.stop and not self.detokenize:  # vLLM's rule: stop strings match the text
            raise ValueError(f"stop strings {self.stop!r} need detokenize=True")
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids or ())

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(
                    f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}"
                )
            bad = [
                (t, b)
                for t, b in self.logit_bias.items()
                if not _is_token_id(t) or not _is_number(b) or not math.isfinite(b)
            ]
            if bad:
                raise ValueError(
                    f"logit_bias needs token ids (ints in [0, {INT32_MAX}]) mapped to "
                    f"finite numbers, got {bad[:5]!r}"
                )
            self.logit_bias = {
                int(t): min(max(float(b), -100.0), 100.0) for t, b in self.logit_bias.items()
            }
        if self.allowed_token_ids is not None:
            # Duplicates dropped: the worker pads every row to the longest list.
            self.allowed_token_ids = list(
                dict.fromkeys(_token_ids("allowed_token_ids", self.allowed_token_ids))
            )
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")

        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens)
            or self.truncate_prompt_tokens == 0
            or self.truncate_prompt_tokens < -1
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be an int >= 1 or -1, "
                f"got {self.truncate_prompt_tokens!r}"
            )
        if self.bad_words is not None:
            self.bad_words = (
                [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            )
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be non-blank strings, got {self.bad_words[:5]!r}")
        if self.bad_words_token_ids is not None:
            if isinstance(self.bad_words_token_ids, (str, bytes)) or not all(
                isinstance(w, (list, tuple)) for w in self.bad_words_token_ids
            ):
                raise TypeError(
                    f"bad_words_token_ids must be a list of token-id lists, "
                    f"got {self.bad_words_token_ids!r}"
                )
            if any(not w or not all(map(_is_token_id, w)) for w in self.bad_words_token_ids):
                raise ValueError(
                    f"bad_words_token_ids must be non-empty lists of token ids (ints in "
                    f"[0, {INT32_MAX}]), got {self.bad_words_token_ids[:5]!r}"
                )
            self.bad_words_token_ids = [[int(t) for t in w] for w in self.bad_words_token_ids]

        if self.greedy:
            # n > 1 with greedy is allowed (vLLM V1): the n completions are identical.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    @property
    def greedy(self) -> bool:
        """True when ``temperature < 1e-5`` (vLLM treats that as temperature 0)."""
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM


def resolve_logprobs(
    params: SamplingParams, *, vocab_size: int, max_logprobs: int
) -> SamplingParams:
    """``params`` with ``logprobs`` / ``prompt_logprobs`` of -1 resolved to ``vocab_size``
    (a copy; ``params`` itself when nothing changes), after vLLM V1's check: a count above
    ``max_logprobs`` (-1: ``vocab_size``) is a ValueError, as is one above the vocabulary.
    Only the counts are compared, so nothing is allocated in
    proportion to them here.

    >>> resolve_logprobs(SamplingParams(logprobs=-1), vocab_size=512, max_logprobs=-1).logprobs
    512
    """
    cap = max_logprobs if max_logprobs != -1 else None
    counts = {}
    for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        asked = getattr(params, name)
        if asked is None:
            continue
        k = vocab_size if asked == -1 else asked
        if cap is not None and k > cap:
            raise ValueError(
                f"Requested {what} logprobs of {k}, which is greater than max allowed: "
                f"{cap} ({name}={asked}; the engine's max_logprobs, -1 for the vocabulary "
                f"size, raises the cap)"
            )
        if k > vocab_size:
            raise ValueError(f"{name}={asked} is larger than the vocabulary size {vocab_size}")
        if k != asked:
            counts[name] = k
    return dataclasses.replace(params, **counts) if counts else params
