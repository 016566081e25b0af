"""Per-row sampling inputs: the :class:`SamplingMetadata` pytree and its host-side builder.

The runner builds one SamplingMetadata per step on the host (plain numpy leaves, packed into
the step's one host->device transfer); :mod:`jaxkv.worker.sampler` reads it on the device.

Shape names: ``S`` request rows (padded to a bucket), ``W`` the width of the penalty history
(prompt then output tokens), ``Lb`` / ``La`` / ``Lz`` the padded lengths of the banned-token,
allowed-token and logit-bias lists, ``Bw`` the number of bad words per row and ``R`` the
longest bad word's length less one.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import numpy as np

from jaxkv.sampling_params import SAMPLING_EPS
from jaxkv.worker.buckets import pow2_at_least

#: Padding entry of the token-id lists in SamplingMetadata (counts nothing, bans nothing).
PAD_TOKEN_ID = -1

_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling inputs for S rows. Padding rows are greedy with neutral parameters."""

    temperature: jax.Array         # [S] float32; < SAMPLING_EPS means greedy
    top_k: jax.Array               # [S] int32; 0 = off
    top_p: jax.Array               # [S] float32; 1 = off
    min_p: jax.Array               # [S] float32; 0 = off
    presence_penalty: jax.Array    # [S] float32; 0 = off
    frequency_penalty: jax.Array   # [S] float32; 0 = off
    repetition_penalty: jax.Array  # [S] float32; 1 = off
    key_data: jax.Array            # [S, 2] uint32, the request's threefry key (make_request_key)
    num_output_tokens: jax.Array   # [S] int32, tokens generated so far (folded into the key)
    history_token_ids: jax.Array   # [S, W] int32: prompt then output tokens; W = 0 unless use_penalties
    num_prompt_tokens: jax.Array   # [S] int32: the first this many history columns are the prompt
    num_history_tokens: jax.Array  # [S] int32: columns past this are ignored
    pending_token_ids: jax.Array   # [S] int32: an output token not in the history yet (async
                                   #   scheduling: sampled by the step in flight; the step fills
                                   #   it from its inputs), PAD_TOKEN_ID for none
    banned_token_ids: jax.Array    # [S, Lb] int32, PAD_TOKEN_ID-padded; set to -inf this step
    num_banned_outputs: jax.Array  # [S] int32: the bans hold for the row's next this many outputs
                                   #   (min_tokens - outputs; scored draft positions past it are free)
    allowed_token_ids: jax.Array   # [S, La] int32, PAD_TOKEN_ID-padded; a row with any entry
                                   #   keeps only those tokens; La = 0 when no row has a list
    bias_token_ids: jax.Array      # [S, Lz] int32, PAD_TOKEN_ID-padded (logit_bias keys)
    bias_values: jax.Array         # [S, Lz] float32, added to those tokens' logits
    bad_word_prefix_ids: jax.Array  # [S, Bw, R] int32: each bad word but its last token,
                                    #   right-aligned, PAD_TOKEN_ID on the left
    bad_word_last_ids: jax.Array    # [S, Bw] int32: each bad word's last token, PAD_TOKEN_ID for none
    recent_output_ids: jax.Array    # [S, R] int32: the row's last R output tokens on the host,
                                    #   right-aligned, PAD_TOKEN_ID on the left
    all_greedy: bool = True        # static: skip temperature, truncation and the random draw
    use_penalties: bool = False    # static: apply repetition / frequency / presence penalties
    use_top_k_top_p: bool = False  # static: some random row has top_k > 0 or top_p < 1
    max_num_logprobs: int | None = None  # static: None = no logprobs; K >= 0 = sampled + top-K

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def reads_pending(self) -> bool:
        """Static: whether sampling reads ``pending_token_ids`` (penalties count it; multi-token
        bad words match it as the latest output), so the step must fill it in."""
        return self.use_penalties or (self.bad_word_last_ids.shape[1] > 0
                                      and self.recent_output_ids.shape[1] > 0)


jax.tree_util.register_dataclass(
    SamplingMetadata,
    data_fields=[
        "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "key_data", "num_output_tokens", "history_token_ids",
        "num_prompt_tokens", "num_history_tokens", "pending_token_ids", "banned_token_ids",
        "num_banned_outputs",
        "allowed_token_ids", "bias_token_ids", "bias_values", "bad_word_prefix_ids",
        "bad_word_last_ids", "recent_output_ids",
    ],
    meta_fields=["all_greedy", "use_penalties", "use_top_k_top_p", "max_num_logprobs"],
)


# ---- keys -------------------------------------------------------------------------------------


def make_request_key(seed: int) -> np.ndarray:  # [2] uint32
    """Threefry key data of a request seed (any int; taken modulo 2**64), computed on the host.

    Equals ``jax.random.key_data(jax.random.PRNGKey(seed))`` for 0 <= seed < 2**32; larger
    seeds keep their high 32 bits (PRNGKey drops them when x64 is off).
    """
    seed %= 1 << 64
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def make_unseeded_request_key(engine_seed: int, req_id: str) -> np.ndarray:  # [2] uint32
    """Key of a request without a seed: a stable hash of (engine seed, request id).

    vLLM request ids are unique within an engine, so the id plays the role of a per-request
    counter; unlike a counter it needs no state and survives preemption and re-adding.
    """
    digest = hashlib.blake2b(f"{engine_seed}\0{req_id}".encode(), digest_size=8).digest()
    return make_request_key(int.from_bytes(digest, "little"))


def _pow2_bucket(n: int, min_size: int) -> int:
    """0 for n == 0, else :func:`pow2_at_least` (n, min_size)."""
    return 0 if n == 0 else pow2_at_least(n, min_size)


def _pad_lists(lists: Sequence[Sequence[int]], num_rows: int, width: int) -> np.ndarray:
    out = np.full((num_rows, width), PAD_TOKEN_ID, np.int32)  # [S, width]
    for i, ids in enumerate(lists):
        out[i, : len(ids)] = ids
    return out


def uses_penalties(params) -> bool:
    """Whether sampling a row reads its prompt and generated tokens (repetition, frequency or
    presence penalty), not only their count."""
    return (getattr(params, "presence_penalty", 0.0) != 0 or getattr(params, "frequency_penalty", 0.0) != 0
            or getattr(params, "repetition_penalty", 1.0) != 1)


def reads_token_ids(params) -> bool:
    """Whether building a row's metadata needs its tokens: penalties, or a bad word of more
    than one token (matched against the latest outputs)."""
    return uses_penalties(params) or any(
        len(w) > 1 for w in getattr(params, "bad_words_token_ids", None) or ())


def build_sampling_metadata(
    params: Sequence,                       # [n] SamplingParams (or duck-typed), real rows
    key_data: np.ndarray,                   # [n, 2] uint32, make_request_key / make_unseeded_...
    num_output_tokens: Sequence[int],       # [n] tokens generated so far per row
    token_ids: Sequence[Sequence[int]] | None = None,  # [n] prompt then output tokens (reads_token_ids)
    num_prompt_tokens: Sequence[int] | None = None,    # [n] prompt length of each (reads_token_ids)
    *,
    num_rows: int,                          # S >= n: the request bucket
    eos_token_id: int | None = None,
    vocab_size: int | None = None,          # needed only to resolve logprobs=-1 (whole vocab)
    min_history_bucket: int = 256,
) -> SamplingMetadata:
    """Builds the (numpy) SamplingMetadata of one step for rows ``0..n-1``, padded to S rows.

    Padding rows are greedy with neutral parameters. Static fields, chosen so the jitted step
    sees few variants: ``all_greedy``, ``use_penalties``, ``use_top_k_top_p`` from the rows;
    ``max_num_logprobs`` = the largest requested K rounded up to a power of two (each row
    then keeps its own first K + 1 columns). The history width W (each row's prompt then its
    output) is a power of two >= ``min_history_bucket``, 0 when no row uses penalties: one
    width for both parts, so a run with penalties compiles once per doubling of the longest
    row, not per (prompt, output) pair of sizes. ``min_tokens``: while a row
    has fewer outputs, its stop token ids (and EOS unless ``ignore_eos``) are banned. Bad words
    (``bad_words_token_ids``) are padded to ``Bw`` words of ``R + 1`` tokens (powers of two
    from 4, 0 when unused); each row with a multi-token word also gets its last R outputs.
    """
    n = len(params)
    if n > num_rows:
        raise ValueError(f"{n} requests do not fit in a bucket of {num_rows} rows")
    f32 = np.float32
    temperature = np.zeros(num_rows, f32)
    top_k = np.zeros(num_rows, np.int32)
    top_p = np.ones(num_rows, f32)
    min_p = np.zeros(num_rows, f32)
    presence = np.zeros(num_rows, f32)
    frequency = np.zeros(num_rows, f32)
    repetition = np.ones(num_rows, f32)
    keys = np.zeros((num_rows, 2), np.uint32)
    keys[:n] = np.asarray(key_data, np.uint32).reshape(n, 2)
    steps = np.zeros(num_rows, np.int32)
    steps[:n] = num_output_tokens

    banned: list[list[int]] = []
    ban_outputs = np.zeros(num_rows, np.int32)
    max_logprobs = None
    for i, p in enumerate(params):
        temperature[i] = p.temperature
        top_k[i] = max(int(p.top_k), 0)  # -1 = off, as 0
        top_p[i], min_p[i] = p.top_p, p.min_p
        presence[i], frequency[i] = p.presence_penalty, p.frequency_penalty
        repetition[i] = p.repetition_penalty
        if steps[i] < getattr(p, "min_tokens", 0):
            stop_ids = list(getattr(p, "stop_token_ids", None) or [])
            if eos_token_id is not None and not getattr(p, "ignore_eos", False):
                stop_ids.append(eos_token_id)
            banned.append(stop_ids)
            # min_tokens may exceed int32 (any int is valid; max_model_len ends the row first)
            ban_outputs[i] = min(p.min_tokens - int(steps[i]), _INT32_MAX)
        else:
            banned.append([])
        k = getattr(p, "logprobs", None)
        if k is not None:
            if k == -1:
                if vocab_size is None:
                    raise ValueError("logprobs=-1 (whole vocab) needs vocab_size")
                k = vocab_size
            max_logprobs = max(max_logprobs or 0, int(k))

    is_random = temperature[:n] >= SAMPLING_EPS
    use_penalties = any(uses_penalties(p) for p in params)
    use_top_k_top_p = bool(np.any(is_random & ((top_k[:n] > 0) | (top_p[:n] < 1))))
    if max_logprobs is not None:
        max_logprobs = _pow2_bucket(max_logprobs, 1)
        if vocab_size is not None:
            max_logprobs = min(max_logprobs, vocab_size)

    if (token_ids is None or num_prompt_tokens is None) and any(map(reads_token_ids, params)):
        raise ValueError("penalties and multi-token bad words need token_ids and num_prompt_tokens per row")
    num_prompt = np.zeros(num_rows, np.int32)
    num_history = np.zeros(num_rows, np.int32)
    if use_penalties:
        num_prompt[:n] = num_prompt_tokens
        num_history[:n] = [len(x) for x in token_ids]
        width = pow2_at_least(max(int(num_history.max(initial=0)), 1), min_history_bucket)
        history = _pad_lists(token_ids, num_rows, width)
    else:
        history = np.zeros((num_rows, 0), np.int32)
    banned_arr = _pad_lists(banned, num_rows, _pow2_bucket(max(map(len, banned), default=0), 4))
    allowed = [list(getattr(p, "allowed_token_ids", None) or ()) for p in params]
    allowed_arr = _pad_lists(allowed, num_rows, _pow2_bucket(max(map(len, allowed), default=0), 4))
    biases = [getattr(p, "logit_bias", None) or {} for p in params]
    width = _pow2_bucket(max(map(len, biases), default=0), 4)
    bias_ids = _pad_lists([list(b) for b in biases], num_rows, width)
    bias_values = np.zeros((num_rows, width), np.float32)
    for i, b in enumerate(biases):
        bias_values[i, : len(b)] = list(b.values())

    words = [getattr(p, "bad_words_token_ids", None) or () for p in params]
    num_words = _pow2_bucket(max(map(len, words), default=0), 4)
    r = _pow2_bucket(max((len(w) - 1 for ws in words for w in ws), default=0), 4) if num_words else 0
    word_prefix = np.full((num_rows, num_words, r), PAD_TOKEN_ID, np.int32)
    word_last = np.full((num_rows, num_words), PAD_TOKEN_ID, np.int32)
    recent = np.full((num_rows, r), PAD_TOKEN_ID, np.int32)
    for i, ws in enumerate(words):
        for b, w in enumerate(ws):
            word_last[i, b] = w[-1]
            word_prefix[i, b, r - len(w) + 1:] = w[:-1]
        if r and any(len(w) > 1 for w in ws):
            outputs = token_ids[i][int(num_prompt_tokens[i]):]
            tail = outputs[max(len(outputs) - r, 0):]
            recent[i, r - len(tail):] = tail

    return SamplingMetadata(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        key_data=keys, num_output_tokens=steps,
        history_token_ids=history, num_prompt_tokens=num_prompt, num_history_tokens=num_history,
        pending_token_ids=np.full(num_rows, PAD_TOKEN_ID, np.int32), banned_token_ids=banned_arr,
        num_banned_outputs=ban_outputs,
        allowed_token_ids=allowed_arr, bias_token_ids=bias_ids, bias_values=bias_values,
        bad_word_prefix_ids=word_prefix, bad_word_last_ids=word_last, recent_output_ids=recent,
        all_greedy=not bool(np.any(is_random)),
        use_penalties=use_penalties,
        use_top_k_top_p=use_top_k_top_p,
        max_num_logprobs=max_logprobs,
    )
