"""The tokenizer stored in GGUF metadata -> `jaxkv.models.tokenizer.Tokenizer`.

Two ``tokenizer.ggml.model`` kinds are supported, both built as `tokenizers` BPE models:

``"gpt2"`` -- byte-level BPE: ``tokens`` (id order), ``merges`` (``"a b"`` strings, rank
order), ``token_type`` (1 normal, 3 control, 4 user defined, ...), special ids and
``add_bos_token``. ``tokenizer.ggml.pre`` names the pre-tokenizer; the splits below are
llama.cpp's ``llama-vocab.cpp`` tables expressed as `tokenizers` components (e.g. "smollm":
each digit alone, then GPT-2's regex).

``"llama"`` -- a SentencePiece BPE vocabulary (llama.cpp's SPM vocab: Llama 2, Mistral v0.1,
Gemma 1-3, ...): pieces spell a space as "▁" (U+2581) and carry ``scores``; there are usually
no stored merges. The tokenizer is what HF's LlamaTokenizerFast / GemmaTokenizerFast build:

* BPE with ``byte_fallback`` (a character no piece covers becomes its UTF-8 byte pieces
  ``<0xNN>``), ``fuse_unk`` and the ``unknown_token_id`` piece as unk.
* Merges: ``tokenizer.ggml.merges`` when stored, else derived from the vocabulary: (a, b) is
  a merge when a, b and a+b are all pieces, ranked by the score of a+b (higher first; equal
  scores: longer a, then longer b, then lower id of a+b -- transformers' ``generate_merges``
  order). Pieces that are not normal (control, user defined, byte) rank first, by id: they are
  atomic symbols in SentencePiece, and this is also the order transformers' Gemma GGUF loader
  gets by ranking every merge by the id of a+b.
* Normalizer: " " -> "▁"; with ``add_space_prefix`` (default true, Llama 2) "▁" is prepended
  to each text segment (the Llama 2 tokenizer.json / llama.cpp / sentencepiece behaviour),
  and the decoder strips that one leading space again. Without it (Gemma) nothing is
  prepended and the text is one BPE sequence (Gemma's ``Split(" ", merged_with_previous)``
  pre-tokenizer is kept; after the normalizer there is no " " left, so it never splits).
* Decoder: "▁" -> " ", byte pieces -> bytes (ByteFallback), Fuse.
* Control (type 3) and unknown (type 2) pieces are special added tokens and user-defined
  pieces (type 4) plain added tokens, matched whole in the raw text (so "<start_of_turn>"
  is one id). Gemma stores its user-defined runs of spaces with real spaces ("  "); those are
  spelled back as "▁▁" pieces (as llama.cpp's converter wrote them the other way round), and
  a pre-tokenizer split isolates each run the way SentencePiece's user-defined matching (and
  llama.cpp's) cuts it: longest first, left to right (40 spaces: 31 + 9). BPE then makes each
  one piece. transformers leaves the runs to the merges alone and differs past 31 spaces.
* BOS is prepended when ``add_bos_token`` (default true for this kind, as in llama.cpp), EOS
  appended when ``add_eos_token``.
"""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from jaxkv.models.tokenizer import Tokenizer

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

SPM_SPACE = "\u2581"

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
      ValueError: a tokenizer model other than "gpt2" or "llama", an unknown pre-tokenizer
        ("gpt2"), or a token list with duplicates.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        return None
    if kind == "gpt2":
        return _gpt2_tokenizer(meta, list(tokens))
    if kind == "llama":
        return _spm_tokenizer(meta, list(tokens))
    raise ValueError(
        f"GGUF tokenizer model {kind!r} is not supported "
        "(only 'gpt2' byte-level BPE and 'llama' SentencePiece BPE)"
    )


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(
            f"GGUF token list has duplicates ({len(tokens)} tokens, {len(vocab)} distinct)"
        )
    return vocab


def _wrap(meta: dict[str, Any], backend: tokenizers.Tokenizer) -> Tokenizer:
    return Tokenizer(
        backend,
        bos_token_id=_special_id(meta, "bos"),
        eos_token_id=_special_id(meta, "eos"),
        pad_token_id=_special_id(meta, "padding"),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _add_tokens(
    backend: tokenizers.Tokenizer,
    tokens: list[str],
    types,
    *,
    special_types: tuple[int, ...],
    skip: set[int] = frozenset(),
) -> None:
    """Pieces of ``special_types`` as special added tokens, user-defined ones (but ``skip``)
    as plain added tokens: each matched whole in the raw text."""
    backend.add_special_tokens(
        [
            tokenizers.AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t in special_types
        ]
    )
    backend.add_tokens(
        [
            tokenizers.AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == TOKEN_TYPE_USER_DEFINED and i not in skip
        ]
    )


def _gpt2_tokenizer(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = _vocab(tokens)
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
    _add_tokens(backend, tokens, types, special_types=(TOKEN_TYPE_CONTROL,))

    bos = _special_id(meta, "bos")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)],
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return _wrap(meta, backend)


def _spm_merges(tokens: list[str], vocab: dict[str, int], scores, types) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary (see the module docstring for the order)."""
    ranked = []
    get = vocab.get
    for i, piece in enumerate(tokens):
        n = len(piece)
        if n < 2:
            continue
        if types[i] == TOKEN_TYPE_NORMAL:
            head = (1, -float(scores[i]))
        else:
            head = (0, i)
        for k in range(1, n):
            left = piece[:k]
            if left in vocab:
                right = piece[k:]
                if get(right) is not None:
                    ranked.append((head, -k, k - n, i, left, right))
    ranked.sort(key=lambda r: r[:4])
    return [(r[4], r[5]) for r in ranked]


def _spm_tokenizer(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    n = len(tokens)
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * n)
    scores = meta.get("tokenizer.ggml.scores")
    if len(types) != n or (scores is not None and len(scores) != n):
        raise ValueError(f"GGUF token_type/scores lengths do not match the {n} tokens")
    if scores is None:  # no scores: SentencePiece orders pieces best first
        scores = [-float(i) for i in range(n)]

    # User-defined runs of spaces, stored with real spaces (Gemma): back to "▁" pieces for BPE.
    spelled = list(tokens)
    respelled = set()
    present = set(tokens)
    for i, tok in enumerate(tokens):
        if tok and types[i] == TOKEN_TYPE_USER_DEFINED and tok.strip(" ") == "":
            alt = SPM_SPACE * len(tok)
            if alt not in present:
                spelled[i] = alt
                respelled.add(i)
    vocab = _vocab(spelled)

    stored = meta.get("tokenizer.ggml.merges")
    if stored:
        merges = [tuple(m.split(" ", 1)) for m in stored]
    else:
        merges = _spm_merges(spelled, vocab, scores, types)

    unk = _special_id(meta, "unknown")
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None if unk is None else spelled[unk],
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", SPM_SPACE)
    if add_prefix:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), replace])
        backend.pre_tokenizer = None
    else:
        backend.normalizer = replace
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    if respelled:
        # SentencePiece matches user-defined pieces longest first, left to right, before BPE
        # (llama.cpp too, on the raw text): a run of 40 spaces is the 31-space piece then the
        # 9-space one, never 16 + 24 as merges would build it. Isolate each such match.
        lengths = sorted({len(spelled[i]) for i in respelled}, reverse=True)
        runs = tokenizers.Regex("|".join(f"{SPM_SPACE}{{{k}}}" for k in lengths))
        split = pre_tokenizers.Split(runs, behavior="isolated")
        backend.pre_tokenizer = (
            split
            if backend.pre_tokenizer is None
            else pre_tokenizers.Sequence([backend.pre_tokenizer, split])
        )
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)

    _add_tokens(
        backend,
        spelled,
        types,
        special_types=(TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN),
        skip=respelled,
    )

    bos, eos = _special_id(meta, "bos"), _special_id(meta, "eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        pre = [spelled[bos]] if add_bos else []
        post = [spelled[eos]] if add_eos else []
        single = pre + ["$A"] + post
        pair = single + [f"{t}:1" for t in pre] + ["$B:1"] + [f"{t}:1" for t in post]
        used = {bos} if add_bos else set()
        if add_eos:
            used.add(eos)
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(single),
            pair=" ".join(pair),
            special_tokens=[(spelled[i], i) for i in sorted(used)],
        )
    return _wrap(meta, backend)
