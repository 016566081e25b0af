"""Speculative decoding by n-gram prompt lookup (vLLM's ``speculative_config={"method": "ngram"}``).

After a step the runner proposes up to ``num_speculative_tokens`` draft tokens per request: the
tokens that followed the most recent earlier occurrence of the request's last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, the longest match wins), searched over its
prompt and outputs. The scheduler feeds them as extra tokens of the next step; the step scores
every position and keeps the longest prefix of drafts the target model agrees with, plus one
token of its own (see ``jaxkv.worker.sampler.sample_and_verify``), so greedy outputs are exactly
the ones without speculation, and sampled ones follow the same distribution.

Host side (numpy): the config, the proposer, and whether a step's requests get drafts (``disable_by_batch_size``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from jaxkv.worker.buckets import pick_bucket
from jaxkv.worker.heads import VerifyInputs

METHODS = ("ngram",)


def _is_pos_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's n-gram speculative config (names and defaults).

    Attributes:
      method: "ngram" (prompt lookup; the only method here).
      num_speculative_tokens: drafts per request and step (k >= 1).
      prompt_lookup_max / prompt_lookup_min: longest / shortest n-gram matched. vLLM's
        defaults: both 5 when neither is given, else the missing one equals the other.
      disable_by_batch_size: no drafts are proposed after a step that ran this many requests
        or more (vLLM's option of that name; None: always propose). Scoring drafts costs
        compute in proportion to the tokens scored, which large batches on a compute-bound
        device (a CPU) do not have to spare: on 2 CPU cores a 64-row step with ~50 drafts
        took ~2x a plain decode step.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not _is_pos_int(self.num_speculative_tokens):
            raise ValueError(
                f"num_speculative_tokens must be an int >= 1, got {self.num_speculative_tokens!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if not _is_pos_int(lo) or not _is_pos_int(hi) or lo > hi:
            raise ValueError(
                f"prompt_lookup_min / prompt_lookup_max must be ints with 1 <= min <= max, "
                f"got {self.prompt_lookup_min!r} / {self.prompt_lookup_max!r}"
            )
        if self.disable_by_batch_size is not None and not _is_pos_int(self.disable_by_batch_size):
            raise ValueError(
                f"disable_by_batch_size must be an int >= 1 or None, "
                f"got {self.disable_by_batch_size!r}"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, or a dict of its fields (vLLM's ``speculative_config``)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config must be a dict or None, got {value!r}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}")
        return cls(**value)


def propose_ngram(
    tokens: np.ndarray,  # [L] int32: the request's prompt then outputs
    min_n: int,
    max_n: int,
    k: int,
) -> list[int]:
    """Up to ``k`` draft tokens: what followed the most recent earlier occurrence of the
    last n tokens, for the largest n in [min_n, max_n] that occurs; [] when none does.

    Example: tokens [1, 2, 3, 9, 1, 2], n = 2: [1, 2] occurred at 0, followed by [3, 9, 1, ...]
    -> k = 2 gives [3, 9].
    """
    length = int(tokens.shape[0])
    if k <= 0 or length < 2:
        return []
    # Where an earlier occurrence of the last token ends (it must be followed by a token):
    # one O(L) comparison, then the candidates' match lengths grow backwards, at most max_n.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # [C]
    matched = np.ones(ends.shape[0], np.int32)  # [C] suffix match length
    alive = np.ones(ends.shape[0], bool)
    for j in range(1, min(max_n, length - 1)):
        ok = alive & (ends >= j)
        ok[ok] = tokens[ends[ok] - j] == tokens[length - 1 - j]
        matched += ok
        alive = ok
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hits = ends[matched >= n]
        if hits.size:
            start = int(hits[-1]) + 1
            return tokens[start : start + k].tolist()
    return []


def batch_may_speculate(config: SpeculativeConfig, num_requests: int) -> bool:
    """Whether requests of a step that ran ``num_requests`` requests get drafts for the next."""
    limit = config.disable_by_batch_size
    return limit is None or num_requests < limit


# ---- a step with drafts: which positions it scores, and which tokens it keeps ------------------


def verify_inputs(
    qsl: np.ndarray,  # [n + 1] int32 query start of each row (at least)
    drafts: list[list[int]],  # [n] each row's drafts scored this step
    rows: dict[str, np.ndarray],  # per row [n]: slots, num_output_tokens,
    #   num_history_tokens, num_logprobs, samples
    *,
    buckets,
    num_drafts: int,
    num_batch_rows: int,
    neutral_slot: int,
) -> tuple[VerifyInputs, np.ndarray, np.ndarray]:
    """The positions a step with drafts scores: P = rows + drafts, padded to a bucket.

    Row i with m drafts scores its last m + 1 tokens (its last confirmed token, then the
    drafts) at positions start_i .. start_i + m: position start_i + j checks draft j, follows
    drafts 0 .. j - 1 and samples output ``num_output_tokens + j``; start_i + m samples the
    bonus token. A row without drafts scores one position and samples as without speculation.

    Returns the ``verify[P]`` inputs, ``sample_index`` [P] (the step token each position reads)
    and ``start`` [n] int32.
    """
    n = len(drafts)
    counts = np.array([len(d) + 1 for d in drafts], np.int32)  # [n]
    start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    total = int(counts.sum())
    x = VerifyInputs.empty(pick_bucket(total, buckets), num_drafts, num_batch_rows, neutral_slot)
    row = np.repeat(np.arange(n), counts)  # [total] its row
    offset = np.arange(total) - np.repeat(start, counts)
    x.offsets[:total] = offset
    for name in ("slots", "num_history_tokens", "num_logprobs", "samples"):
        getattr(x, name)[:total] = rows[name][row]
    x.num_output_tokens[:total] = rows["num_output_tokens"][row] + offset
    last = np.maximum(qsl[1 : n + 1] - 1, 0)  # [n] each row's last scheduled token
    index = np.zeros(x.slots.shape[0], np.int32)
    index[:total] = np.repeat(last - counts + 1, counts) + offset
    for i, d in enumerate(drafts):
        x.drafts[start[i] : start[i] + len(d)] = d
        for j in range(1, len(d) + 1):  # position start_i + j follows drafts[:j]
            x.prior_drafts[start[i] + j, :j] = d[:j]
    x.row_last[:n] = start + counts - 1
    return x, index, start


def accepted_tokens(tokens: list[int], accepted, start: int, drafts) -> list[int]:
    """A row's new tokens: with m drafts, its tokens at positions start .. start + m up to
    and including the first that did not accept its draft (the bonus position, start + m,
    always ends it)."""
    m = len(drafts)
    new = []
    for j in range(m + 1):
        new.append(tokens[start + j])
        if j == m or not accepted[start + j]:
            break
    return new


def propose_drafts(
    cfg: SpeculativeConfig,
    token_ids: list[int],
    max_tokens: int | None,
    num_generated: int,
    max_model_len: int,
) -> list[int]:
    """Drafts for a request's next step (n-gram lookup over its tokens), within its
    max_tokens and max_model_len (the step's own sample comes on top of them)."""
    room = max_model_len - 1 - len(token_ids)
    if max_tokens is not None:
        room = min(room, max_tokens - num_generated - 1)
    k = min(cfg.num_speculative_tokens, room)
    if k <= 0:
        return []
    return propose_ngram(
        np.asarray(token_ids, np.int32), cfg.prompt_lookup_min, cfg.prompt_lookup_max, k
    )
