"""LLMEngine: the glue between the host core and the worker (schedule -> execute -> update);
``jaxkv.llm.LLM`` drives it for offline batches.

Quick start::

    from jaxkv import LLM, SamplingParams
    llm = LLM("tiny-llama", kv_cache_memory_bytes=64 << 20)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, temperature=0))
    print(outs[0].outputs[0].token_ids)
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Sequence

from jaxkv.core import EngineCoreOutput, Request, RequestStatus, Scheduler
from jaxkv.core.errors import EngineStepError, blame, caused_by_interrupt, culprit_of
from jaxkv.core.recovery import abort_failed_steps, drop_all_kv, remove_requests, reset_scheduler
from jaxkv.detokenizer import IncrementalDetokenizer
from jaxkv.engine_config import EngineConfig, resolve_engine_config
from jaxkv.input_processor import InputProcessor
from jaxkv.interrupts import DeferredInterrupt
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
from jaxkv.worker.model_runner import ModelRunner
from jaxkv.models.sharding import make_tp_mesh


#: What a pooling request's core ``Request`` carries: one greedy step's worth (the worker
#: returns its hidden states and never a token), output only when it finishes.
_POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                   output_kind=RequestOutputKind.FINAL_ONLY)


@dataclasses.dataclass
class _Child:
    """One completion of a request (vLLM fans ``n > 1`` out into n child requests)."""

    index: int
    request_id: str          # the core's id
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detok: IncrementalDetokenizer | None = None
    sent_tokens: int = 0     # DELTA outputs: tokens and text already returned
    sent_text: int = 0
    sent_finished: bool = False   # DELTA outputs: finish_reason already returned


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
    sent_prompt_logprobs: int = 0   # DELTA outputs: prompt logprobs already returned
    pooling: PoolingParams | None = None   # a pooling request (resolved), and its result
    pooled: object = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Build it with :meth:`from_config` (or through :class:`LLM`). ``add_request`` validates and
    queues; ``step`` runs one schedule -> execute -> update cycle and returns the outputs of
    the requests that made progress.
    """

    def __init__(self, model, model_config, tokenizer, config: EngineConfig, *, verbose: bool = False):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self.kv_cache_config = config.kv_cache_config
        self.scheduler = Scheduler(config.kv_cache_config, config.scheduler_config)
        self.input_processor = InputProcessor(config, model_config, tokenizer)
        self.runner = ModelRunner(
            model, config.kv_cache_config, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, attention_backend=config.attention_backend,
            cache_dtype=config.cache_dtype, seed=config.seed, eos_token_id=self.input_processor.eos_token_id,
            speculative_config=config.speculative_config, logprobs_mode=config.logprobs_mode,
            mesh=make_tp_mesh(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None)
        # bad_words encoded, so warm-up compiles the widths requests use; a pooling-only
        # engine never decodes, so its decode steps are not warmed up.
        if config.warmup and config.runner != "pooling":
            self.runner.warmup(progress=verbose, prefill=config.warmup == "all",
                               sampling=[self.input_processor.with_bad_words_ids("warmup", p) for p in config.warmup_sampling])
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[_Parent, _Child]] = {}
        self._counter = itertools.count()
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.step_seconds = 0.0
        self.num_steps = 0
        self.peak_kv_cache_usage = 0.0
        self.prefix_hit_tokens = 0
        self._last_stats = None
        self._in_flight = None   # async scheduling: (SchedulerOutput, StepHandle) not yet collected
        self._pending_outputs: list = []   # outputs of a step that then raised, returned next

    @classmethod
    def from_config(cls, model: str = "tiny-llama", **kwargs) -> "LLMEngine":
        loaded, model_config, tokenizer, config = resolve_engine_config(model, **kwargs)
        return cls(loaded, model_config, tokenizer, config, verbose=kwargs.get("verbose", False))

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt, params: SamplingParams | PoolingParams | None = None, *,
                    priority: int = 0, cache_salt: str | None = None) -> None:
        """Validates and queues a request; raises ValueError/TypeError with no state change.

        With ``PoolingParams`` it is a pooling request: it runs its prompt only and ``step``
        returns one ``PoolingRequestOutput`` when the prompt is done (task "embed" unless the
        params say otherwise)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise TypeError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
        refused = {"pooling": SamplingParams, "generate": PoolingParams}.get(self.config.runner)
        if refused is not None and isinstance(params, refused):
            raise ValueError(f"this engine was built with runner={self.config.runner!r}: it takes no "
                             f"{refused.__name__} requests (runner='auto' takes both)")
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {cache_salt!r}")
        if self._in_flight is not None:
            child_ids = {request_id} | {f"{i}_{request_id}" for i in range(getattr(params, "n", 1))}
            busy = sorted(child_ids & set(self._in_flight[0].num_scheduled_tokens))
            if busy:   # its results would be taken for the new request's
                raise ValueError(f"request id {request_id!r} is still in the step in flight (as {busy}); "
                                 "reuse it after the next step()")
        text, ids = self.input_processor.tokenize(prompt)
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, text, ids, params, priority, cache_salt)
            return
        ids, params = self.input_processor.process_generation(request_id, ids, params)
        n = params.n
        children = []
        requests = []
        for i in range(n):
            child_id = request_id if n == 1 else f"{i}_{request_id}"
            child_params = params
            if n > 1:   # seed + i taken mod 2**64 (the sampler's key is), so it stays in range
                child_params = dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else (params.seed + i) % (1 << 64))
            req = Request(child_id, ids, child_params, eos_token_id=self.input_processor.eos_token_id,
                          priority=priority, cache_salt=cache_salt)
            requests.append(req)
            detok = None
            if self.tokenizer is not None and params.detokenize:   # detokenize=False: no text
                detok = IncrementalDetokenizer(
                    self.tokenizer, stop=list(params.stop or []),
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    skip_special_tokens=params.skip_special_tokens)
            children.append(_Child(index=i, request_id=child_id, detok=detok,
                                   logprobs=[] if params.logprobs is not None else None,
                                   cumulative_logprob=0.0 if params.logprobs is not None else None))
        try:
            for req in requests:
                self.scheduler.add_request(req)
        except BaseException:   # a refused child, or an interrupt: none of them stays
            remove_requests(self.scheduler, {r.request_id for r in requests} & set(self.scheduler.requests))
            raise
        parent = _Parent(request_id, text, ids, params, children,
                         RequestMetrics(arrival_time=time.perf_counter()),
                         prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self._parents[request_id] = parent
        for c in children:
            self._child_of[c.request_id] = (parent, c)

    def _add_pooling_request(self, request_id: str, text, ids: list[int], params: PoolingParams,
                             priority: int, cache_salt) -> None:
        ids, pp = self.input_processor.process_pooling(request_id, ids, params)
        self.scheduler.add_request(Request(request_id, ids, _POOLING_SAMPLING, priority=priority,
                                           cache_salt=cache_salt, pooling_params=pp))
        parent = _Parent(request_id, text, ids, _POOLING_SAMPLING, [_Child(index=0, request_id=request_id)],
                         RequestMetrics(arrival_time=time.perf_counter()), pooling=pp)
        self._parents[request_id] = parent
        self._child_of[request_id] = (parent, parent.children[0])

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Aborts requests. Ids that are not running (finished already, or never added) are
        ignored, as in vLLM: a request may finish between the caller's last output and its
        abort. Ids must be strings (TypeError otherwise)."""
        if isinstance(request_ids, str):
            ids = [request_ids]
        elif isinstance(request_ids, Iterable) and not isinstance(request_ids, (bytes, bytearray)):
            ids = list(request_ids)
        else:
            raise TypeError(f"request ids must be str (or an iterable of str), got {request_ids!r}")
        bad = [r for r in ids if not isinstance(r, str)]
        if bad:
            raise TypeError(f"request ids must be str, got {bad[:5]!r}")
        for rid in ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            live = [c.request_id for c in parent.children if c.finish_reason is None]
            if live:
                self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            for c in parent.children:
                self._child_of.pop(c.request_id, None)
        if self._pending_outputs:   # an aborted request gets no more outputs
            gone = set(ids)
            self._pending_outputs = [o for o in self._pending_outputs if o.request_id not in gone]

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self._in_flight is not None
                or bool(self._pending_outputs))

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block (vLLM's ``reset_prefix_cache``), e.g. after
        changing the weights in place. Only possible while no request holds blocks: returns
        False, changing nothing, otherwise."""
        return self.scheduler.reset_prefix_cache()

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One schedule -> execute -> update cycle; the outputs of requests that made progress.

        With ``async_scheduling`` the cycle is pipelined one deep (vLLM's async scheduling):
        this call schedules and dispatches step N+1, then waits for step N and returns N's
        outputs, so the host's scheduling and input preparation overlap the device's work and
        outputs arrive one call later.

        A step is all or nothing for its requests. If any part of it raises (scheduling,
        input preparation, the device step, collecting its results, output processing),
        every request of the failed step (with async scheduling, of the step in flight too;
        with ``n > 1``, every completion of the same prompt) is finished as aborted, blocks
        the step had put into the prefix cache are removed from it (their KV may be
        unwritten), and the worker's batch, block tables and KV buffers are made valid again
        (buffers a failed call had donated are re-created; then every other running request
        is recomputed). Other requests carry on. An ``Exception`` then surfaces as
        :class:`jaxkv.core.errors.EngineStepError` (the original as its cause) naming the
        request being handled when known and the requests aborted; a KeyboardInterrupt or
        other BaseException is re-raised as it is, with a note. Requests that did nothing
        wrong are aborted, not re-queued: a failure nobody can attribute would otherwise
        repeat forever. A Ctrl-C (SIGINT, main thread) that arrives during a step lets the
        step finish and raises KeyboardInterrupt after it; that step's outputs are returned
        by the next call. A second Ctrl-C during the same step raises at once.
        """
        with DeferredInterrupt() as interrupt:
            try:
                outputs = self._step_once()
            except BaseException as exc:
                error = self._recover(exc)
                if error is exc:
                    raise
                raise error from exc
        if self._pending_outputs:
            outputs, self._pending_outputs = self._pending_outputs + outputs, []
        if interrupt.pending:
            self._pending_outputs = outputs
            raise KeyboardInterrupt("interrupted during LLMEngine.step (the step completed; "
                                    "its outputs come with the next step())")
        return outputs

    def _step_once(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if not self.scheduler.async_scheduling:
            so = self.scheduler.schedule()
            self._mark_scheduled(so)
            core_outputs = self.scheduler.update_from_output(so, self.runner.execute_model(so))
            self._account(so, t0)
            return self._process(core_outputs)
        core_outputs = []
        so = self.scheduler.schedule()
        self._mark_scheduled(so)
        handle = self.runner.dispatch(so)
        if self._in_flight is not None:
            core_outputs += self._finish_in_flight()
        elif handle is None and self.scheduler.has_unfinished_requests():
            stuck = {r.request_id: r.num_output_placeholders for r in self.scheduler.running}
            raise RuntimeError(f"async scheduling made no progress: nothing scheduled and no step in "
                               f"flight; running requests (id: placeholders) {stuck}")
        if handle is not None:   # None: nothing was scheduled, so there is nothing to update
            self._in_flight = (so, handle)
        outputs = self._process(core_outputs)   # may finish requests (stop strings)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            # Every request of the step in flight has finished: its tokens are dropped, and
            # collecting it now leaves the engine idle when the last output is returned.
            outputs += self._process(self._finish_in_flight())
        self._account(so, t0)
        return outputs

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        so, handle = self._in_flight
        self._in_flight = None
        return self.scheduler.update_from_output(so, self.runner.collect(handle))

    def _mark_scheduled(self, so) -> None:
        now = time.perf_counter()
        for rid in so.num_scheduled_tokens:
            pc = self._child_of.get(rid)
            if pc is not None and pc[0].metrics.first_scheduled_time is None:
                pc[0].metrics.first_scheduled_time = now

    def _account(self, so, t0: float) -> None:
        self.step_seconds += time.perf_counter() - t0
        self.num_steps += 1
        self._last_stats = self.scheduler.make_stats()
        self.peak_kv_cache_usage = max(self.peak_kv_cache_usage, self._last_stats.kv_cache_usage)
        self.num_prompt_tokens_computed += so.total_num_scheduled_tokens

    # ---- failed steps -------------------------------------------------------------------------

    def _recover(self, exc: BaseException) -> BaseException:
        """Undoes a failed step (see :meth:`step`); returns the exception to raise."""
        culprit = culprit_of(exc)
        kv_lost = False
        aborted: list[str] = []
        try:
            self._in_flight = None
            ids = abort_failed_steps(self.scheduler, {culprit} - {None})
            aborted = self._abort_orphaned_parents()   # with the other completions of their prompts
            if self.runner.recover_after_failure(ids):
                kv_lost = True
                drop_all_kv(self.scheduler)
        except BaseException:  # noqa: BLE001 - recovery itself broke: start from nothing
            reset_scheduler(self.scheduler)
            kv_lost = self.runner.recover_after_failure(list(self.runner.requests)) or kv_lost
        aborted += self._abort_orphaned_parents()   # what a reset aborted
        self._last_stats = None   # get_stats() reads the state after the recovery
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        where = f" while handling request {culprit!r}" if culprit is not None else ""
        message = (f"engine step failed{where} ({what}); aborted requests {aborted}"
                   + ("; the KV cache was lost and the other running requests will be recomputed"
                      if kv_lost else ""))
        if not isinstance(exc, Exception):   # KeyboardInterrupt, SystemExit: keep their type
            exc.add_note(f"jaxkv: {message}")
            return exc
        if caused_by_interrupt(exc):   # a library turned an interrupt into its own error
            interrupt = KeyboardInterrupt(message)
            interrupt.__cause__ = exc
            return interrupt
        return EngineStepError(message, request_id=culprit, aborted_request_ids=aborted,
                               kv_cache_lost=kv_lost)

    def _abort_orphaned_parents(self) -> list[str]:
        """Aborts every request with a completion the core no longer has (aborted by a
        recovery, or finished without its output being processed), the other completions
        included; returns their ids."""
        live = self.scheduler.requests
        orphaned = [rid for rid, parent in self._parents.items()
                    if any(c.finish_reason is None and c.request_id not in live for c in parent.children)]
        self.abort_request(orphaned)
        return orphaned

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """The outputs of ``core_outputs``. One that fails to process does not stop the
        others: the rest are processed, their outputs kept for the next ``step()``, and the
        first error is raised (naming its request) for ``step`` to abort that request."""
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
                if pc is not None:   # step() aborts its request: it gets no output
                    failed.add(pc[0].request_id)
        for rid in failed:
            touched.pop(rid, None)
        outputs = self._outputs_of(touched, now)
        if error is not None:
            self._pending_outputs += outputs
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
                    self.scheduler.finish_requests([child.request_id], RequestStatus.FINISHED_STOPPED)
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
                if finished:   # a pooling request's one output
                    outputs.append(PoolingRequestOutput(
                        parent.request_id, PoolingOutput(parent.pooled), list(parent.prompt_token_ids),
                        finished, prompt=parent.prompt, metrics=parent.metrics,
                        num_cached_tokens=parent.num_cached_tokens))
            elif finished or kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(parent, delta=kind == RequestOutputKind.DELTA,
                                                 streamed=kind != RequestOutputKind.FINAL_ONLY))
        return outputs

    def _to_logprobs(self, lp) -> dict[int, Logprob]:
        ids, lps, ranks = lp
        out = {}
        for t, l, r in zip(ids, lps, ranks):
            if t not in out:
                dec = self.tokenizer.decode([t]) if self.tokenizer is not None else None
                out[int(t)] = Logprob(float(l), int(r), dec)
        return out

    def _make_output(self, parent: _Parent, *, delta: bool = False, streamed: bool = True) -> RequestOutput:
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
            news = (len(c.token_ids) > c.sent_tokens or len(text) > c.sent_text
                    or (c.finish_reason is not None and not c.sent_finished))
            start, tstart = (c.sent_tokens, c.sent_text) if delta else (0, 0)
            c.sent_finished = c.finish_reason is not None
            if not news and len(parent.children) > 1 and streamed:
                continue
            completions.append(CompletionOutput(
                index=c.index, text=text[tstart:], token_ids=c.token_ids[start:],
                cumulative_logprob=c.cumulative_logprob,
                logprobs=c.logprobs[start:] if c.logprobs is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            c.sent_tokens, c.sent_text = len(c.token_ids), len(text)
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=list(parent.prompt_token_ids),
            prompt_logprobs=self._delta_prompt_logprobs(parent) if delta else parent.prompt_logprobs,
            outputs=completions, finished=parent.finished, metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens)

    @staticmethod
    def _delta_prompt_logprobs(parent: _Parent) -> list | None:
        if parent.prompt_logprobs is None:
            return None
        new = parent.prompt_logprobs[parent.sent_prompt_logprobs:]
        parent.sent_prompt_logprobs = len(parent.prompt_logprobs)
        return new or None

    # ---- stats --------------------------------------------------------------------------------

    def get_stats(self) -> dict:
        st = self._last_stats or self.scheduler.make_stats()
        stats = dict(
            kv_cache_usage=st.kv_cache_usage, num_running_reqs=st.num_running_reqs,
            num_waiting_reqs=st.num_waiting_reqs, prefix_cache_hit_rate=st.prefix_cache_hit_rate,
            num_preemptions=st.num_preemptions, peak_kv_cache_usage=self.peak_kv_cache_usage,
            prefix_hit_tokens=self.prefix_hit_tokens,
            num_compiles=self.runner.num_compiles,
            compile_seconds=round(self.runner.compile_seconds, 3),
            num_steps=self.num_steps,
            generated_tokens=self.num_generated_tokens,
            scheduled_tokens=self.num_prompt_tokens_computed,
            output_tokens_per_s=(self.num_generated_tokens / self.step_seconds) if self.step_seconds else 0.0,
        )
        if self.config.speculative_config is not None:   # vLLM's spec-decode counters
            drafts, accepted = self.runner.num_draft_tokens, self.runner.num_accepted_tokens
            stats.update(spec_num_draft_tokens=drafts, spec_num_accepted_tokens=accepted,
                         spec_acceptance_rate=accepted / drafts if drafts else 0.0)
        return stats

    def next_request_id(self) -> str:
        return str(next(self._counter))
