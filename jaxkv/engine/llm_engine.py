"""LLMEngine (vLLM V1's shape): input processor -> engine core -> output processor.

``LLM`` drives it for offline batches. The engine core (scheduler + executor, no jax) runs in
this process; its executor reaches the workers in process (default) or in worker processes
(``distributed_executor_backend="mp"``).

Quick start::

    from jaxkv import LLM, SamplingParams
    llm = LLM("tiny-llama", kv_cache_memory_bytes=64 << 20)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, temperature=0))
    print(outs[0].outputs[0].token_ids)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence

from jaxkv.core import EngineCoreOutput, RequestStatus
from jaxkv.core.errors import EngineStepError, caused_by_interrupt, culprit_of
from jaxkv.engine.core import EngineCore
from jaxkv.engine.output_processor import OutputProcessor
from jaxkv.engine.stats import EngineStats, SpecDecodeStats
from jaxkv.engine_config import EngineConfig, resolve_engine_config
from jaxkv.executor import Executor
from jaxkv.input_processor import InputProcessor
from jaxkv.interrupts import DeferredInterrupt
from jaxkv.outputs import RequestOutput
from jaxkv.pooling_params import PoolingParams
from jaxkv.sampling_params import SamplingParams


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Build it with :meth:`from_config` (or through :class:`LLM`). ``add_request`` validates and
    queues; ``step`` runs one schedule -> execute -> update cycle and returns the outputs of
    the requests that made progress.

    Args:
      model: an NNX model built in this process, or None (the workers load ``config.model``).
      model_config, tokenizer: the model's config and tokenizer (the front end needs no weights).
      config: the resolved ``EngineConfig``.
    """

    def __init__(
        self, model, model_config, tokenizer, config: EngineConfig, *, verbose: bool = False
    ):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self.input_processor = InputProcessor(config, model_config, tokenizer)
        self.engine_core = EngineCore(config, Executor.get_class(config), model)
        self.kv_cache_config = self.engine_core.kv_cache_config
        self.output_processor = OutputProcessor(tokenizer)
        self._counter = itertools.count()
        self.num_prompt_tokens_computed = 0
        self.step_seconds = 0.0
        self.num_steps = 0
        self.peak_kv_cache_usage = 0.0
        self._last_stats = None

    @classmethod
    def from_config(cls, model: str = "tiny-llama", **kwargs) -> LLMEngine:
        loaded, model_config, tokenizer, config = resolve_engine_config(model, **kwargs)
        return cls(loaded, model_config, tokenizer, config, verbose=kwargs.get("verbose", False))

    @property
    def scheduler(self):
        """The engine core's scheduler."""
        return self.engine_core.scheduler

    @property
    def runner(self):
        """The in-process worker's ``ModelRunner`` (tests and benchmarks inspect it);
        AttributeError with a multi-process executor, whose runners live in the workers."""
        executor = self.engine_core.model_executor
        if not hasattr(executor, "model_runner"):
            raise AttributeError(
                f"{type(executor).__name__} runs its model runners in worker processes"
            )
        return executor.model_runner

    def shutdown(self) -> None:
        """Stops the workers (an in-process executor has none to stop)."""
        self.engine_core.shutdown()

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Validates and queues a request; raises ValueError/TypeError with no state change.

        With ``PoolingParams`` it is a pooling request: it runs its prompt only and ``step``
        returns one ``PoolingRequestOutput`` when the prompt is done (task "embed" unless the
        params say otherwise)."""
        params = self.input_processor.check_args(request_id, params, priority, cache_salt)
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        in_flight = self.engine_core.in_flight_request_ids()
        if in_flight:
            child_ids = {request_id} | {f"{i}_{request_id}" for i in range(getattr(params, "n", 1))}
            busy = sorted(child_ids & in_flight)
            if busy:  # its results would be taken for the new request's
                raise ValueError(
                    f"request id {request_id!r} is still in the step in flight (as {busy}); "
                    "reuse it after the next step()"
                )
        req = self.input_processor.process(
            request_id, prompt, params, priority=priority, cache_salt=cache_salt
        )
        # The front end learns of the request first: an interrupt that lands between the two
        # leaves a request abort_request finds (aborting ids the core never got is a no-op);
        # the other order could leave core requests no front-end id names.
        self.output_processor.add_request(
            request_id,
            req.prompt,
            req.prompt_token_ids,
            req.params,
            [r.request_id for r in req.core_requests],
            pooling=req.pooling_params,
        )
        try:
            self.engine_core.add_requests(req.core_requests)  # all or none
        except BaseException:  # the core queued none, or (interrupted on the way out) all
            self.abort_request(request_id)
            raise

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
        self.engine_core.finish_requests(self.output_processor.abort_requests(ids))

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests() or bool(
            self.output_processor.pending_outputs
        )

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block (vLLM's ``reset_prefix_cache``), e.g. after
        changing the weights in place. Only possible while no request holds blocks: returns
        False, changing nothing, otherwise."""
        return self.engine_core.reset_prefix_cache()

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
        op = self.output_processor
        if op.pending_outputs:
            outputs, op.pending_outputs = op.pending_outputs + outputs, []
        if interrupt.pending:
            op.pending_outputs = outputs
            raise KeyboardInterrupt(
                "interrupted during LLMEngine.step (the step completed; "
                "its outputs come with the next step())"
            )
        return outputs

    def _step_once(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        core_outputs, so = self.engine_core.step()
        self.output_processor.mark_scheduled(
            so.num_scheduled_tokens, self.engine_core.last_schedule_time
        )
        outputs = self._process(core_outputs)  # may finish requests (stop strings)
        if self.config.scheduler_config.async_scheduling:
            outputs += self._process(self.engine_core.finish_in_flight_if_idle())
        self._account(so, t0)
        return outputs

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """The output processor's outputs; completions it finished by a stop string are
        finished in the core (also when processing raised)."""
        op = self.output_processor
        try:
            return op.process_outputs(core_outputs)
        finally:
            stopped, op.reqs_to_abort = op.reqs_to_abort, []
            self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)

    def _account(self, so, t0: float) -> None:
        self.step_seconds += time.perf_counter() - t0
        self.num_steps += 1
        self._last_stats = self.engine_core.make_stats()
        self.peak_kv_cache_usage = max(self.peak_kv_cache_usage, self._last_stats.kv_cache_usage)
        self.num_prompt_tokens_computed += so.total_num_scheduled_tokens

    # ---- failed steps -------------------------------------------------------------------------

    def _recover(self, exc: BaseException) -> BaseException:
        """Undoes a failed step (see :meth:`step`); returns the exception to raise."""
        culprit = culprit_of(exc)
        kv_lost, aborted = self.engine_core.recover(culprit, self._abort_orphaned_parents)
        self._last_stats = None  # get_stats() reads the state after the recovery
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        where = f" while handling request {culprit!r}" if culprit is not None else ""
        message = f"engine step failed{where} ({what}); aborted requests {aborted}" + (
            "; the KV cache was lost and the other running requests will be recomputed"
            if kv_lost
            else ""
        )
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: keep their type
            exc.add_note(f"jaxkv: {message}")
            return exc
        if caused_by_interrupt(exc):  # a library turned an interrupt into its own error
            interrupt = KeyboardInterrupt(message)
            interrupt.__cause__ = exc
            return interrupt
        return EngineStepError(
            message, request_id=culprit, aborted_request_ids=aborted, kv_cache_lost=kv_lost
        )

    def _abort_orphaned_parents(self) -> list[str]:
        """Aborts every request with a completion the core no longer has (aborted by a
        recovery, or finished without its output being processed), the other completions
        included; returns their ids."""
        orphaned = self.output_processor.orphaned_requests(self.engine_core.has_request)
        self.abort_request(orphaned)
        return orphaned

    # ---- stats --------------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        """The engine's counters now (``EngineStats``)."""
        st = self._last_stats or self.engine_core.make_stats()
        runner = self.engine_core.model_executor.get_runner_stats()
        op = self.output_processor
        spec_decode = None
        if self.config.speculative_config is not None:  # vLLM's spec-decode counters
            drafts, accepted = runner["num_draft_tokens"], runner["num_accepted_tokens"]
            spec_decode = SpecDecodeStats(
                num_draft_tokens=drafts,
                num_accepted_tokens=accepted,
                acceptance_rate=accepted / drafts if drafts else 0.0,
            )
        return EngineStats(
            kv_cache_usage=st.kv_cache_usage,
            num_running_reqs=st.num_running_reqs,
            num_waiting_reqs=st.num_waiting_reqs,
            prefix_cache_hit_rate=st.prefix_cache_hit_rate,
            num_preemptions=st.num_preemptions,
            peak_kv_cache_usage=self.peak_kv_cache_usage,
            prefix_hit_tokens=op.prefix_hit_tokens,
            num_compiles=runner["num_compiles"],
            compile_seconds=round(runner["compile_seconds"], 3),
            num_programs=runner["num_programs"],
            late_compiles=len(runner["late_compiles"]),
            num_steps=self.num_steps,
            generated_tokens=op.num_generated_tokens,
            scheduled_tokens=self.num_prompt_tokens_computed,
            output_tokens_per_s=(op.num_generated_tokens / self.step_seconds)
            if self.step_seconds
            else 0.0,
            spec_decode=spec_decode,
        )

    def next_request_id(self) -> str:
        return str(next(self._counter))

    @property
    def num_generated_tokens(self) -> int:
        return self.output_processor.num_generated_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        return self.output_processor.prefix_hit_tokens
