"""AsyncLLM (vLLM V1's): an asyncio front end over an engine core in its own process.

The front end tokenises and validates (``InputProcessor``), sends the core its requests over
pyzmq, and one output-reader task turns the core's per-step outputs into ``RequestOutput``s
(``OutputProcessor``: detokenising, stop strings, output kinds) and puts each into its
request's asyncio queue. ``generate`` yields from that queue::

    engine = AsyncLLM("tiny-llama", kv_cache_memory_bytes=64 << 20, max_model_len=256)
    params = SamplingParams(max_tokens=8, output_kind=RequestOutputKind.DELTA)
    async for out in engine.generate([1, 2, 3], params, "req-1"):
        print(out.outputs[0].token_ids)
    engine.shutdown()

Cancelling the consumer (or closing the generator) aborts the request in the core, which
frees its blocks. A core process that dies fails every waiting request with
``EngineDeadError`` and every later call too; a step that fails in the core fails its
requests with ``EngineStepError`` and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator

from jaxkv.core import RequestStatus
from jaxkv.core.errors import EngineStepError, culprit_of
from jaxkv.engine.codec import CoreOutputs
from jaxkv.engine.core_client import EngineCoreClient, EngineDeadError, wait_for_exit
from jaxkv.engine.output_processor import OutputProcessor
from jaxkv.input_processor import InputProcessor
from jaxkv.outputs import PoolingRequestOutput, RequestOutput
from jaxkv.pooling_params import PoolingParams
from jaxkv.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError", "IterationStats"]


_ABORTED = object()  # queued by abort(): ends the request's generator


@dataclasses.dataclass
class IterationStats:
    """What one message from the core changed (vLLM's ``IterationStats``), for stat loggers."""

    num_prompt_tokens: int = 0  # prompts of the core requests that produced their first output
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    finished: list[tuple[str, float]] = dataclasses.field(
        default_factory=list
    )  # (reason, e2e seconds)


@dataclasses.dataclass
class _Timing:
    arrival: float
    num_prompt_tokens: int
    last: float | None = None


class AsyncLLM:
    """An engine-core process and the asyncio front end that streams its outputs.

    Args:
      model: a model name or path (the core process loads it).
      startup_timeout_s: longest wait for the core to be ready.
      step_timeout_s: with requests waiting, the longest silence from the core (one step,
        a compile included) before it is declared dead and killed.
      engine_kwargs: ``LLM``'s engine arguments (``resolve_engine_config``).
    """

    def __init__(
        self,
        model: str = "tiny-llama",
        *,
        startup_timeout_s: float = 600.0,
        step_timeout_s: float = 600.0,
        **engine_kwargs,
    ):
        self.engine_core = EngineCoreClient(
            model, engine_kwargs, startup_timeout_s=startup_timeout_s
        )
        self.config = self.engine_core.config
        self.model_config = self.engine_core.model_config
        self.tokenizer = self.engine_core.tokenizer
        self.input_processor = InputProcessor(self.config, self.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.step_timeout_s = step_timeout_s
        self.stat_loggers: list = []  # objects with record(CoreStats | None, IterationStats)
        self.scheduler_stats = None  # the core's latest CoreStats
        self._queues: dict[str, asyncio.Queue] = {}
        self._timing: dict[str, _Timing] = {}  # core id -> arrival, last token
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the readers' loop
        self._last_message = time.monotonic()

    # ---- state ----------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        try:
            self.engine_core.check_alive()
        except EngineDeadError:
            return True
        return self._reader is not None and self._reader.done()

    def check_health(self) -> None:
        """Raises EngineDeadError when the core process (or the output reader) is gone."""
        self.engine_core.check_alive()
        if self._reader is not None and self._reader.done():
            raise self.engine_core.mark_dead(f"the output reader stopped: {self._reader_error()}")

    def _reader_error(self) -> str:
        exc = self._reader.exception() if not self._reader.cancelled() else None
        return f"{type(exc).__name__}: {exc}" if exc is not None else "cancelled"

    def get_tokenizer(self):
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ---- requests -------------------------------------------------------------------------------

    async def generate(
        self, prompt, sampling_params: SamplingParams | None, request_id: str, *, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as the core produces them (``sampling_params.output_kind``:
        CUMULATIVE, DELTA or FINAL_ONLY), the last one ``finished``. ValueError / TypeError
        on bad input (before anything is queued)."""
        stream = await self.add_request(
            request_id, prompt, sampling_params or SamplingParams(), priority=priority
        )
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def encode(
        self, prompt, pooling_params: PoolingParams | None, request_id: str, *, priority: int = 0
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request's one output (its pooled hidden states)."""
        stream = await self.add_request(
            request_id, prompt, pooling_params or PoolingParams(task="embed"), priority=priority
        )
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def add_request(
        self, request_id: str, prompt, params: SamplingParams | PoolingParams, *, priority: int = 0
    ) -> AsyncGenerator:
        """Validates and queues a request now (ValueError / TypeError naming the field, nothing
        queued); returns the stream of its outputs. Iterate the stream to its end, close it
        after iterating, or call :meth:`abort`: a stream left alone keeps its request running.
        The servers add every prompt of a call this way before reading any output, so a bad
        prompt refuses the call before anything runs."""
        return self._stream(request_id, self._add_request(request_id, prompt, params, priority))

    async def _stream(self, request_id: str, queue: asyncio.Queue):
        finished = False
        try:
            while True:
                out = await queue.get()
                if out is _ABORTED:  # abort(): the stream ends without a final output
                    finished = True
                    return
                if isinstance(out, BaseException):
                    finished = True  # the engine has already forgotten it
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # cancelled, closed or failed: free its blocks
                self._abort(request_id)

    def _add_request(self, request_id: str, prompt, params, priority: int) -> asyncio.Queue:
        self._ensure_started()
        if self.output_processor.has_request(request_id) or request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.input_processor.process(request_id, prompt, params, priority=priority)
        arrival = time.perf_counter()
        self.engine_core.add_requests(req.core_requests)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        child_ids = [r.request_id for r in req.core_requests]
        self.output_processor.add_request(
            request_id,
            req.prompt,
            req.prompt_token_ids,
            req.params,
            child_ids,
            pooling=req.pooling_params,
        )
        for cid in child_ids:
            self._timing[cid] = _Timing(arrival, len(req.prompt_token_ids))
        return queue

    async def abort(self, request_id: str) -> None:
        """Aborts a request (its consumer gets no more outputs); unknown ids are ignored."""
        self._abort(request_id)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(_ABORTED)

    def _abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        core_ids = self.output_processor.abort_requests([request_id])
        for cid in core_ids:
            self._timing.pop(cid, None)
        if core_ids and self.engine_core.dead is None:
            self.engine_core.abort_requests(core_ids, status)

    # ---- the output reader ----------------------------------------------------------------------

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._reader is not None and self._loop is not loop and self._loop.is_closed():
            # The reader's event loop has ended (one asyncio.run per call): serve from this one.
            self._reader = self._watcher = None
        self.check_health()
        if self._reader is None:
            self._loop = loop
            self._reader = loop.create_task(self._read_outputs(), name="jaxkv-output-reader")
            self._watcher = loop.create_task(self._watch_process(loop), name="jaxkv-core-watcher")

    async def _watch_process(self, loop) -> None:
        await wait_for_exit(self.engine_core.proc, loop)
        self._fail_all(
            self.engine_core.mark_dead(
                f"the engine-core process died (exit code {self.engine_core.proc.poll()})"
            )
        )

    async def _read_outputs(self) -> None:
        sock = self.engine_core.async_output_socket()
        try:
            while True:
                msg = await self.engine_core.get_output(sock, timeout_s=1.0)
                now = time.monotonic()
                if msg is None:
                    if self._queues and now - self._last_message > self.step_timeout_s:
                        raise self.engine_core.mark_dead(
                            f"the engine core sent nothing for {self.step_timeout_s:.0f} s with "
                            f"{len(self._queues)} requests waiting"
                        )
                    if not self._queues:
                        self._last_message = now
                    continue
                self._last_message = now
                self._handle(msg)
        except EngineDeadError as exc:
            self._fail_all(exc)
            raise
        except Exception as exc:
            self._fail_all(
                self.engine_core.mark_dead(f"the output reader failed: {type(exc).__name__}: {exc}")
            )
            raise

    def _handle(self, msg: CoreOutputs) -> None:
        op = self.output_processor
        if msg.failed:
            self._fail_core_ids(msg.failed, msg.error or "the engine failed the request")
        it = IterationStats()
        now = time.perf_counter()
        for co in msg.outputs:
            t = self._timing.get(co.request_id)
            if t is None:
                continue
            n = len(co.new_token_ids)
            it.num_generation_tokens += n
            if t.last is None and (n or co.finish_reason is not None):
                it.num_prompt_tokens += t.num_prompt_tokens
                if n:
                    it.time_to_first_tokens.append(now - t.arrival)
            elif n:
                it.inter_token_latencies.append(now - t.last)
            if n or t.last is None:
                t.last = now
            if co.finish_reason is not None:
                it.finished.append((co.finish_reason, now - t.arrival))
                del self._timing[co.request_id]
        if msg.scheduled:
            op.mark_scheduled(msg.scheduled, msg.schedule_time)
        try:
            outputs = op.process_outputs(msg.outputs)
        except Exception as exc:  # noqa: BLE001 - one request's processing failed: fail that one
            outputs, op.pending_outputs = op.pending_outputs, []
            self._fail_request(culprit_of(exc), exc)
        finally:
            stopped, op.reqs_to_abort = op.reqs_to_abort, []
            for cid in stopped:  # finished by a stop string: the front end knew first
                t = self._timing.pop(cid, None)
                if t is not None:
                    it.finished.append(("stop", now - t.arrival))
            if stopped:
                self.engine_core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        if msg.stats is not None:
            self.scheduler_stats = msg.stats
        for logger in self.stat_loggers:
            logger.record(msg.stats, it)

    def _fail_core_ids(self, core_ids: list[str], error: str) -> None:
        """Fails the requests of ``core_ids`` (a failed step's, or refused at add)."""
        failed = set(core_ids)
        parents = self.output_processor.orphaned_requests(lambda cid: cid not in failed)
        for rid in parents:
            self._fail_request(rid, EngineStepError(error, aborted_request_ids=sorted(parents)))

    def _fail_request(self, request_id: str | None, exc: BaseException) -> None:
        if request_id is None:
            return
        parent_id = self.output_processor.parent_id_of(request_id) or request_id
        self._abort(parent_id)
        queue = self._queues.pop(parent_id, None)
        if queue is not None:
            queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._queues):
            self.output_processor.abort_requests([rid])
            self._queues.pop(rid).put_nowait(exc)
        self._timing.clear()

    # ---- shutdown -------------------------------------------------------------------------------

    def fail_all_requests(self, exc: BaseException) -> None:
        """Ends every open request with ``exc`` (its consumer raises it) and aborts them in the
        core: a server stopping ends its streams with an error rather than cutting them."""
        core_ids = [
            cid for rid in list(self._queues) for cid in self.output_processor.abort_requests([rid])
        ]
        for rid in list(self._queues):
            self._queues.pop(rid).put_nowait(exc)
        self._timing.clear()
        if core_ids and self.engine_core.dead is None:
            with contextlib.suppress(Exception):
                self.engine_core.abort_requests(core_ids)

    def shutdown(self) -> None:
        """Stops the reader and the core process (idempotent)."""
        for task in (self._reader, self._watcher):
            if task is not None and not task.done():
                task.cancel()
        self._fail_all(EngineDeadError("the engine was shut down"))
        self.engine_core.shutdown()

    async def wait_tasks(self) -> None:
        """Waits for the cancelled reader tasks (after ``shutdown``, in their loop)."""
        for task in (self._reader, self._watcher):
            if task is not None:
                with contextlib.suppress(BaseException):
                    await task
