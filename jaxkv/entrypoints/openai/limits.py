"""The server's request limits: what one request may ask for, checked before any expensive
work (tokenising, templating, queuing), each refusal a 4xx in OpenAI's shape naming the field.

Defaults (``jaxkv serve --help`` shows the flags; docs/serving.md explains them):

=========================  =========  ==============================================================
limit                      default    why
=========================  =========  ==============================================================
max_body_bytes             8 MiB      413 before the body is read (Content-Length) or when a chunked
                                      body passes it; a full-length batch of 1,024 prompts fits
max_n                      128        ``n`` and ``best_of`` (OpenAI's own ceiling for ``n``)
max_sequences              2048       ``n`` x prompts of one request (each is one core request)
max_stop                   16         stop strings (OpenAI allows 4) ...
max_stop_chars             256        ... each at most this long
max_logit_bias             1024       ``logit_bias`` entries
max_messages               2048       chat messages
max_prompt_chars           auto       characters of a text prompt (chat: of its messages), refused
                                      before tokenising; auto: max_model_len x the longest token of
                                      the vocabulary in characters, so a refused prompt can never fit
=========================  =========  ==============================================================

Token-id prompts longer than ``max_model_len`` are refused from their length too.
"""

from __future__ import annotations

import dataclasses
import re

from jaxkv.entrypoints.openai.errors import OpenAIError

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for (``None``: no limit). ``max_prompt_chars=None`` is
    resolved by :meth:`resolved` from the tokenizer's vocabulary."""

    max_body_bytes: int = 8 * MiB
    max_n: int = 128
    max_sequences: int = 2048
    max_stop: int = 16
    max_stop_chars: int = 256
    max_logit_bias: int = 1024
    max_messages: int = 2048
    max_prompt_chars: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_prompt_chars":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an int >= 1, got {value!r}")

    def resolved(self, tokenizer, max_model_len: int) -> ServerLimits:
        """``max_prompt_chars`` filled in: ``max_model_len`` x the longest token's length in
        characters (a prompt of more characters needs more tokens than max_model_len)."""
        if self.max_prompt_chars is not None:
            return self
        return dataclasses.replace(
            self, max_prompt_chars=max_model_len * longest_token_chars(tokenizer)
        )

    # ---- checks (each raises OpenAIError naming the field) -------------------------------------

    def check_n(self, n, best_of=None) -> None:
        for name, value in (("n", n), ("best_of", best_of)):
            if isinstance(value, int) and value > self.max_n:
                raise OpenAIError(
                    400,
                    f"{name}={value} is more than this server allows ({self.max_n}, --max-n)",
                    name,
                )

    def check_sequences(self, num_prompts: int, n: int, field: str) -> None:
        if num_prompts > self.max_sequences:
            raise OpenAIError(
                400,
                f"{field} has {num_prompts} prompts: this server takes at most "
                f"{self.max_sequences} in one request (--max-sequences-per-request)",
                field,
            )
        if isinstance(n, int) and num_prompts * n > self.max_sequences:
            raise OpenAIError(
                400,
                f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences: this server "
                f"runs at most {self.max_sequences} for one request "
                "(--max-sequences-per-request)",
                "n",
            )

    def check_stop(self, stop) -> None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > self.max_stop:
            raise OpenAIError(
                400,
                f"stop has {len(stops)} strings: at most {self.max_stop} are allowed (--max-stop)",
                "stop",
            )
        for s in stops:
            if len(s) > self.max_stop_chars:
                raise OpenAIError(
                    400,
                    f"stop string {excerpt(s)} has {len(s)} characters: at most "
                    f"{self.max_stop_chars} are allowed (--max-stop-chars)",
                    "stop",
                )

    def check_logit_bias(self, bias: dict | None) -> None:
        if bias is not None and len(bias) > self.max_logit_bias:
            raise OpenAIError(
                400,
                f"logit_bias has {len(bias)} entries: at most {self.max_logit_bias} are "
                "allowed (--max-logit-bias)",
                "logit_bias",
            )

    def check_messages(self, num: int) -> None:
        if num > self.max_messages:
            raise OpenAIError(
                400,
                f"messages has {num} messages: at most {self.max_messages} are allowed "
                "(--max-messages)",
                "messages",
            )

    def check_prompt_length(self, prompt, max_model_len: int, field: str = "prompt") -> None:
        """A text prompt longer than ``max_prompt_chars``, or token ids more than
        ``max_model_len``: it cannot fit, refused before tokenising."""
        if isinstance(prompt, str):
            if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
                raise OpenAIError(
                    400,
                    f"{field} has {len(prompt)} characters: more than can fit in "
                    f"max_model_len={max_model_len} tokens (at most {self.max_prompt_chars} "
                    "characters, --max-prompt-chars)",
                    field,
                )
        elif len(prompt) > max_model_len:
            raise OpenAIError(
                400,
                f"{field} has {len(prompt)} tokens: more than max_model_len={max_model_len}",
                field,
            )


def longest_token_chars(tokenizer) -> int:
    """The longest token of the vocabulary in characters (its stored form: a byte-level BPE
    token's characters are its bytes, so it bounds the text one token covers); 1 with no
    tokenizer, whose prompts are token ids."""
    if tokenizer is None:
        return 1
    backend = getattr(tokenizer, "backend", None)  # jaxkv's Tokenizer over `tokenizers`
    if backend is not None:
        return max(1, max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1))
    return max(1, max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size)))


def excerpt(value, limit: int = 60) -> str:
    """``repr`` of ``value`` cut to about ``limit`` characters, with the full length named:
    error messages quote what they refuse without copying a large input back."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    if isinstance(value, (list, tuple, dict)) and len(value) > 8:
        items = list(value.items() if isinstance(value, dict) else value)[:8]
        head = repr(dict(items) if isinstance(value, dict) else items)
        text = head[:limit] + "..." if len(head) > limit else head
        return f"{text} ({len(value)} items)"
    text = repr(value)
    return text if len(text) <= limit + 20 else f"{text[:limit]}... ({len(text)} characters)"


_TOKEN_ID_KEY = re.compile(r"-?(?:0|[1-9][0-9]{0,18})")


def parse_token_id_key(key: str) -> int:
    """A ``logit_bias`` key: a canonical decimal integer ("1000", not "1_000", " 1000", "+1000",
    "01000" or non-ASCII digits, all of which ``int`` accepts)."""
    if not _TOKEN_ID_KEY.fullmatch(key):
        raise ValueError(
            f"logit_bias keys must be token ids written as decimal integers, got {excerpt(key)}"
        )
    return int(key)
