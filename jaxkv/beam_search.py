"""Beam search on top of the engine, shaped like vLLM's ``LLM.beam_search`` (no jax import).

Each round turns every live beam into a one-token request that asks for ``2 * beam_width``
logprobs; prefix caching keeps the rounds cheap (a beam's earlier blocks are cache hits, only
its last partial block and new token are computed). Each (beam, candidate token) pair is a
new hypothesis with ``cum_logprob + logprob``; candidates ending in EOS (unless
``ignore_eos``) are complete, the best ``beam_width`` of the others by score go on. After
``max_tokens`` rounds the live beams join the completed ones and the best ``beam_width`` by
score are returned.

Score (vLLM's, after transformers): ``cum_logprob / length ** length_penalty`` where
``length`` counts the prompt and the generated tokens, less a final EOS. Every EOS id of the
model (Llama 3 has several) completes a hypothesis.

The rounds' requests ask for ``2 * beam_width`` logprobs, within the engine's ``max_logprobs``
as every request's (vLLM's rule: with the default 20, beam widths up to 10; a wider search
needs ``LLM(..., max_logprobs=...)``): the sampling programs compute that many logprob
columns for every row, a size fixed when they are compiled.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Collection, Sequence

from jaxkv.outputs import PositionLogprobs


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


EosIds = int | Collection[int] | None  # one EOS id, several (Llama 3), or none


def _eos_set(eos_token_id: EosIds) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    return frozenset([eos_token_id] if isinstance(eos_token_id, numbers.Integral) else eos_token_id)


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (names and defaults).

    Attributes:
      beam_width: hypotheses kept per prompt (>= 1); each round scores ``2 * beam_width``
        candidate tokens per hypothesis.
      max_tokens: rounds, i.e. the most tokens a hypothesis generates (>= 1).
      ignore_eos: keep extending past EOS instead of completing the hypothesis.
      temperature: the candidates are the top logprobs of the model's raw distribution
        whatever the temperature (as in vLLM, where it only changes the token each round's
        request samples, which joins the candidates when it is not among them).
      length_penalty: exponent of the length in the score (1: average logprob per token).
      include_stop_str_in_output: accepted for vLLM compatibility; beam search has no stop
        strings, so it changes nothing.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclasses.dataclass
class BeamSearchSequence:
    """One hypothesis: ``tokens`` holds the prompt then the generated tokens, ``logprobs``
    one dict (the candidates scored at that position) per generated token."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) | "length" (max_tokens or max_model_len)
    stop_reason: int | None = None  # the EOS id when finish_reason is "stop"


@dataclasses.dataclass
class BeamSearchOutput:
    """The best ``beam_width`` hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_id: EosIds, length_penalty: float
) -> float:
    """``cum_logprob / length ** length_penalty``; ``length`` is ``len(tokens)`` (prompt
    included), less one when the last token is an EOS id (``eos_token_id``: one or several)."""
    length = len(tokens) - (1 if tokens and tokens[-1] in _eos_set(eos_token_id) else 0)
    return cum_logprob / (max(length, 1) ** length_penalty)


#: (beam token lists) -> for each, the candidates of its next token (token id -> Logprob),
#: or None when the beam cannot grow (max_model_len).
ExpandFn = Callable[[list[list[int]]], list[PositionLogprobs | None]]


def run_beam_search(
    prompts: Sequence[Sequence[int]],
    params: BeamSearchParams,
    expand: ExpandFn,
    eos_token_id: EosIds,
) -> list[BeamSearchOutput]:
    """The search itself, over an ``expand`` function (the engine's, or a test's);
    ``eos_token_id``: the EOS id, or all of them (each completes a hypothesis)."""
    eos_ids = _eos_set(eos_token_id)
    ignore_eos = params.ignore_eos or not eos_ids

    def score(b: BeamSearchSequence) -> float:
        return beam_search_score(b.tokens, b.cum_logprob, eos_ids, params.length_penalty)

    live = [[BeamSearchSequence(tokens=list(p), logprobs=[])] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        flat = [(i, b) for i, beams in enumerate(live) for b in beams]
        if not flat:
            break
        cands = expand([b.tokens for _, b in flat])
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), lps in zip(flat, cands):
            if lps is None:  # no room left in max_model_len: complete as it is
                beam.finish_reason = "length"
                done[i].append(beam)
                continue
            for tok, lp in lps.items():
                new = BeamSearchSequence(
                    tokens=beam.tokens + [tok],
                    logprobs=beam.logprobs + [lps],
                    cum_logprob=beam.cum_logprob + lp.logprob,
                )
                if not ignore_eos and tok in eos_ids:
                    new.finish_reason, new.stop_reason = "stop", tok
                    done[i].append(new)
                else:
                    grown[i].append(new)
        live = [sorted(g, key=score, reverse=True)[: params.beam_width] for g in grown]
    outputs = []
    for i in range(len(prompts)):
        for b in live[i]:
            b.finish_reason = "length"
        best = sorted(done[i] + live[i], key=score, reverse=True)[: params.beam_width]
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs
