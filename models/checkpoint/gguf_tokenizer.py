"""The tokenizer stored in GGUF metadata -> `jaxkv.models.tokenizer.Tokenizer`.

Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) is supported: ``tokens`` (id order),
``merges`` (``"a b"`` strings, rank order), ``token_type`` (1 normal, 3 control, 4 user
defined, ...), special ids and ``add_bos_token``. ``tokenizer.ggml.pre`` names the
pre-tokenizer; the splits below are llama.cpp's ``llama-vocab.cpp`` tables expressed as
`tokenizers` components (e.g. "smollm": each digit alone, then GPT-2's regex).
"""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from jaxkv.models.tokenizer import Tokenizer

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRES = frozenset({"default", "gpt2", "mpt", "olmo", "jais"})
_DIGITS_THEN_GPT2_PRES = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
)
_REGEX_PRES = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def _pre_tokenizer(pre: str):
    if pre in _GPT2_PRES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _REGEX_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(_REGEX_PRES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted(_GPT2_PRES | _DIGITS_THEN_GPT2_PRES | set(_REGEX_PRES))
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {known})")


def _special_id(meta: dict[str, Any], name: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(value)


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer | None:
    """Builds the tokenizer, or returns None when the file carries no token list.

    Raises:
      ValueError: a tokenizer model other than "gpt2", or an unknown pre-tokenizer.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        return None
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)"
        )
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(
            f"GGUF token list has duplicates ({len(tokens)} tokens, {len(vocab)} distinct)"
        )
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            ignore_merges=meta.get("tokenizer.ggml.pre") in ("llama-bpe", "llama3"),
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()

    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    special = [
        tokenizers.AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t == TOKEN_TYPE_CONTROL
    ]
    user = [
        tokenizers.AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == TOKEN_TYPE_USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user)

    bos = _special_id(meta, "bos")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)],
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_id=_special_id(meta, "eos"),
        pad_token_id=_special_id(meta, "padding"),
        chat_template=meta.get("tokenizer.chat_template"),
    )
