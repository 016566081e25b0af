"""OutputProcessor (vLLM V1's): core outputs -> ``RequestOutput``s in the front end.

It keeps each request's state on the front-end side (the ``n`` completions of a prompt,
their tokens, logprobs and incremental detokenizers), applies stop strings and builds the
outputs of each kind (CUMULATIVE, DELTA, FINAL_ONLY). It never calls into the scheduler: a
completion that a stop string finished is listed in ``reqs_to_abort`` for the engine to
finish in the core. No jax import.
"""

from __future__ import annotations

import dataclasses
import time

from jaxkv.core import EngineCoreOutput
from jaxkv.core.errors import blame
from jaxkv.detokenizer import IncrementalDetokenizer
from jaxkv.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from jaxkv.pooling_params import PoolingParams
from jaxkv.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass
class _Child:
    """One completion of a request (vLLM fans ``n > 1`` out into n child requests)."""

    index: int
    request_id: str  # the core's id
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detok: IncrementalDetokenizer | None = None
    sent_tokens: int = 0  # DELTA outputs: tokens and text already returned
    sent_text: int = 0
    sent_finished: bool = False  # DELTA outputs: finish_reason already returned


@dataclasses.dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    sent_prompt_logprobs: int = 0  # DELTA outputs: prompt logprobs already returned
    pooling: PoolingParams | None = None  # a pooling request (resolved), and its result
    pooled: object = None
    kv_transfer_params: dict | None = None  # the KV connector's, with the finished output

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    """The front end's per-request state and output building.

    Args:
      tokenizer: detokenises outputs and logprob tokens (None: token ids only).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[_Parent, _Child]] = {}
        self.pending_outputs: list = []  # outputs of a step that then raised, returned next
        self.reqs_to_abort: list[str] = []  # core ids finished by stop strings, for the engine
        self.num_generated_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- requests -----------------------------------------------------------------------------

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
        *,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Registers a request whose core requests (one per completion) are ``child_ids``."""
        children = []
        for i, child_id in enumerate(child_ids):
            detok = None
            if self.tokenizer is not None and params.detokenize:  # detokenize=False: no text
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    stop=list(params.stop or []),
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    skip_special_tokens=params.skip_special_tokens,
                )
            logprobs = params.logprobs is not None and pooling is None
            children.append(
                _Child(
                    index=i,
                    request_id=child_id,
                    detok=detok,
                    logprobs=[] if logprobs else None,
                    cumulative_logprob=0.0 if logprobs else None,
                )
            )
        parent = _Parent(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            children,
            RequestMetrics(arrival_time=time.perf_counter()),
            pooling=pooling,
            prompt_logprobs=[None]
            if params.prompt_logprobs is not None and pooling is None
            else None,
        )
        self._parents[request_id] = parent
        for c in children:
            self._child_of[c.request_id] = (parent, c)

    def parent_id_of(self, core_id: str) -> str | None:
        """The request a core request (one completion) belongs to; None when unknown."""
        pc = self._child_of.get(core_id)
        return pc[0].request_id if pc is not None else None

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forgets ``request_ids`` (unknown ones are ignored); the core ids of their
        completions still running, for the engine to abort in the core."""
        live = []
        for rid in request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            live += [c.request_id for c in parent.children if c.finish_reason is None]
            for c in parent.children:
                self._child_of.pop(c.request_id, None)
        if self.pending_outputs:  # an aborted request gets no more outputs
            gone = set(request_ids)
            self.pending_outputs = [o for o in self.pending_outputs if o.request_id not in gone]
        return live

    def orphaned_requests(self, core_has: callable) -> list[str]:
        """Requests with an unfinished completion the core no longer has (aborted by a
        recovery, or finished without its output being processed)."""
        return [
            rid
            for rid, parent in self._parents.items()
            if any(c.finish_reason is None and not core_has(c.request_id) for c in parent.children)
        ]

    def mark_scheduled(self, core_ids, now: float) -> None:
        for rid in core_ids:
            pc = self._child_of.get(rid)
            if pc is not None and pc[0].metrics.first_scheduled_time is None:
                pc[0].metrics.first_scheduled_time = now

    # ---- outputs ------------------------------------------------------------------------------

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> list:
        """The outputs of ``core_outputs``. One that fails to process does not stop the
        others: the rest are processed, their outputs kept in ``pending_outputs`` for the
        next step, and the first error is raised (naming its request) for the engine to
        abort that request. Completions finished by a stop string are added to
        ``reqs_to_abort``."""
        now = time.perf_counter()
        touched: dict[str, _Parent] = {}
        error = None
        failed: set[str] = set()
        for co in core_outputs:
            try:
                self._process_one(co, now, touched)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once the rest are done
                blame(exc, co.request_id)
                error = error or exc
                pc = self._child_of.get(co.request_id)
                if pc is not None:  # the engine aborts its request: it gets no output
                    failed.add(pc[0].request_id)
        for rid in failed:
            touched.pop(rid, None)
        outputs = self._outputs_of(touched, now)
        if error is not None:
            self.pending_outputs += outputs
            raise error
        return outputs

    def _process_one(self, co: EngineCoreOutput, now: float, touched: dict) -> None:
        """Applies one core output to its request (tokens, logprobs, text, finish)."""
        pc = self._child_of.get(co.request_id)
        if pc is None:
            return
        parent, child = pc
        touched[parent.request_id] = parent
        if co.num_cached_tokens and not parent.num_cached_tokens:
            self.prefix_hit_tokens += co.num_cached_tokens
            parent.num_cached_tokens = co.num_cached_tokens
            parent.metrics.num_prefix_hit_tokens = co.num_cached_tokens
        if co.pooling_output is not None:
            parent.pooled = co.pooling_output
        if co.kv_transfer_params is not None:
            parent.kv_transfer_params = co.kv_transfer_params
        if co.new_prompt_logprobs and parent.prompt_logprobs is not None and child.index == 0:
            parent.prompt_logprobs.extend(self._to_logprobs(lp) for lp in co.new_prompt_logprobs)
        if co.new_token_ids:
            self.num_generated_tokens += len(co.new_token_ids)
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
            child.token_ids.extend(co.new_token_ids)
            if child.logprobs is not None and co.new_logprobs:
                for lp in co.new_logprobs:
                    child.logprobs.append(self._to_logprobs(lp))
                    child.cumulative_logprob += lp[1][0]
            if child.detok is not None and child.finish_reason is None:
                matched = child.detok.update(co.new_token_ids)
                if matched is not None and co.finish_reason is None:
                    self.reqs_to_abort.append(child.request_id)
                    child.finish_reason, child.stop_reason = "stop", matched
        if co.finish_reason is not None and child.finish_reason is None:
            child.finish_reason, child.stop_reason = co.finish_reason, co.stop_reason

    def _outputs_of(self, touched: dict, now: float) -> list:
        """The outputs of the requests ``touched`` this step (forgetting finished ones)."""
        outputs = []
        for parent in touched.values():
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
                self._parents.pop(parent.request_id, None)
                for c in parent.children:
                    self._child_of.pop(c.request_id, None)
            kind = parent.params.output_kind
            if parent.pooling is not None:
                if finished:  # a pooling request's one output
                    outputs.append(
                        PoolingRequestOutput(
                            parent.request_id,
                            PoolingOutput(parent.pooled),
                            list(parent.prompt_token_ids),
                            finished,
                            prompt=parent.prompt,
                            metrics=parent.metrics,
                            num_cached_tokens=parent.num_cached_tokens,
                        )
                    )
            elif finished or kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(
                    self._make_output(
                        parent,
                        delta=kind == RequestOutputKind.DELTA,
                        streamed=kind != RequestOutputKind.FINAL_ONLY,
                    )
                )
        return outputs

    def _to_logprobs(self, lp) -> dict[int, Logprob]:
        ids, lps, ranks = lp
        out = {}
        for t, l, r in zip(ids, lps, ranks):
            if t not in out:
                dec = self.tokenizer.decode([t]) if self.tokenizer is not None else None
                out[int(t)] = Logprob(float(l), int(r), dec)
        return out

    def _make_output(
        self, parent: _Parent, *, delta: bool = False, streamed: bool = True
    ) -> RequestOutput:
        """The request's output: everything so far, or with ``delta`` only the tokens, text,
        logprobs and prompt logprobs new since its previous output (None when none are new).

        A streamed (CUMULATIVE or DELTA) output of an ``n > 1`` request holds only the
        completions with something new (tokens, text or their finish), each whole or as its
        delta, as vLLM V1's streaming outputs do; match them by ``index``. FINAL_ONLY's one
        output holds every completion.
        """
        completions = []
        for c in parent.children:
            text = c.detok.text if c.detok is not None else ""
            news = (
                len(c.token_ids) > c.sent_tokens
                or len(text) > c.sent_text
                or (c.finish_reason is not None and not c.sent_finished)
            )
            start, tstart = (c.sent_tokens, c.sent_text) if delta else (0, 0)
            c.sent_finished = c.finish_reason is not None
            if not news and len(parent.children) > 1 and streamed:
                continue
            completions.append(
                CompletionOutput(
                    index=c.index,
                    text=text[tstart:],
                    token_ids=c.token_ids[start:],
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=c.logprobs[start:] if c.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
            c.sent_tokens, c.sent_text = len(c.token_ids), len(text)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=list(parent.prompt_token_ids),
            prompt_logprobs=self._delta_prompt_logprobs(parent)
            if delta
            else parent.prompt_logprobs,
            outputs=completions,
            finished=parent.finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
            kv_transfer_params=parent.kv_transfer_params,
        )

    @staticmethod
    def _delta_prompt_logprobs(parent: _Parent) -> list | None:
        if parent.prompt_logprobs is None:
            return None
        new = parent.prompt_logprobs[parent.sent_prompt_logprobs :]
        parent.sent_prompt_logprobs = len(parent.prompt_logprobs)
        return new or None
