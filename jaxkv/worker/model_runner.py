"""ModelRunner: turns a ``SchedulerOutput`` into one jitted device step.

Per step the runner (1) updates its persistent batch (request id <-> row) and stages the
block-table diff, (2) builds the host inputs in row order and packs them into one int32 array
(one host->device transfer), (3) runs the jitted step with the KV buffers and block tables
donated, and (4) fetches one packed int32 array of results (one device->host transfer).

``execute_model`` does all four; with async scheduling the engine calls ``dispatch`` (1-3)
for step N+1 before ``collect`` (4) of step N, so the host prepares a step while the device
runs the one before it. A token sampled by step N that step N+1 needs as input is read on
the device from N's ``last_sampled`` row: the host never waits for it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.core import ModelRunnerOutput, SchedulerOutput
from jaxkv.core.errors import blame
from jaxkv.kv_cache import KVCacheConfig, cdiv
from jaxkv.worker import kv_memory, prompt_logprobs
from jaxkv.worker.block_table import BlockTableOpsLayout, apply_block_table_ops_jit
from jaxkv.worker.buckets import pick_bucket, pow2_buckets, token_buckets
from jaxkv.worker.input_batch import InputBatch
from jaxkv.worker.packing import pack, unpack_host
from jaxkv.worker.pooler import POOL_ALL, POOL_NONE, POOL_ROWS, PoolAccumulator
from jaxkv.worker.sampling_metadata import build_sampling_metadata
from jaxkv.worker.sampling_adapter import (
    bucket_k,
    gather_rows,
    prompt_logprobs_fn,
    row_logprobs,
    sample_fn,
    spec_sample_fn,
)
from jaxkv.worker.spec_decode import (
    SpeculativeConfig,
    accepted_tokens,
    batch_may_speculate,
    propose_drafts,
    spec_padding,
    spec_step_inputs,
)
from jaxkv.worker.placement import HostPlacement
from jaxkv.worker.step import StepShape, build_step_fn
from jaxkv.models.config import KVCacheBinding
from jaxkv.models.sharding import shard_state

BACKENDS = ("auto", "xla", "cpu", "pallas", "reference")


def resolve_backend(name: str, platform: str | None = None, *, head_size: int | None = None,
                    block_size: int | None = None) -> tuple[str, bool]:
    """("auto" | "xla" | "cpu" | "pallas" | "reference") -> (backend, interpret).

    "auto" is Pallas on GPU/TPU and, on CPU (where Pallas only runs in interpret mode, ~100x
    slower than XLA, measured), the "cpu" backend (the C++ paged-attention kernel) when that
    kernel builds here, else the pure-XLA backend. On TPU "auto" keeps the XLA backend for
    shapes the Mosaic kernel refuses (head_size not a multiple of 128, block_size not a multiple
    of 8); an explicit "pallas" raises there instead. "pallas" on CPU means interpret mode.
    An explicit "cpu" off the CPU platform raises.
    """
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    platform = platform or jax.default_backend()
    if name == "auto":
        if platform == "tpu" and head_size is not None and block_size is not None:
            from jaxkv.pallas_kernels.mosaic_backend import check_shapes  # noqa: PLC0415
            try:
                check_shapes(head_size=head_size, block_size=block_size)
            except ValueError:
                return "xla", False
        if platform in ("gpu", "cuda", "rocm", "tpu"):
            return "pallas", False
        from jaxkv.pallas_kernels import cpu_backend  # noqa: PLC0415
        return ("cpu" if cpu_backend.available() else "xla"), False
    if name == "cpu" and platform != "cpu":
        raise ValueError(f"attention_backend='cpu' runs on the CPU platform only, not {platform!r}")
    return name, (name == "pallas" and platform == "cpu")


@dataclasses.dataclass
class CachedRequestState:
    """What the worker remembers of a request between steps."""

    req_id: str
    token_ids: list[int]             # prompt + generated tokens
    num_prompt_tokens: int
    sampling_params: object
    block_ids: list[list[int]]       # per KV-cache group
    num_computed_tokens: int
    pooling: PoolAccumulator | None = None   # pooling requests only

    @property
    def pools_now(self) -> bool:
        """A pooling request still in its prompt (its rows return hidden states, no token)."""
        return self.pooling is not None and self.num_computed_tokens < self.num_prompt_tokens

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def _lost(x: jax.Array) -> bool:
    """True when ``x`` was donated to a call that failed, or holds that call's error."""
    try:
        if x.is_deleted():
            return True
        x.block_until_ready()
    except Exception:  # noqa: BLE001 - any error reading it back means it is unusable
        return True
    return False


@dataclasses.dataclass
class StepHandle:
    """A dispatched step whose results are still on the device (``ModelRunner.collect``)."""

    shape: StepShape
    out: jax.Array                         # packed results [size] int32, on the device
    states: list[CachedRequestState]       # the step's rows, in row order
    q_lens: np.ndarray                     # [n] int32 tokens scheduled per row
    qsl: np.ndarray                        # [S + 1] int32 query start of each row
    computed: np.ndarray                   # [n] int32 tokens cached before the step
    samples: np.ndarray                    # [n] bool: the row samples a token
    prompt_rows: list[int]                 # rows that compute prompt logprobs this step
    sample_rows: dict[str, int]            # req id -> its row, for rows that sample
    drafts: list[list[int]] = dataclasses.field(default_factory=list)  # per row, drafts scored
    spec_start: np.ndarray | None = None   # [n] int32 each row's first scored position
    pool_rows: list[int] = dataclasses.field(default_factory=list)    # rows of pooling requests

    @property
    def req_ids(self) -> list[str]:
        return [s.req_id for s in self.states]


class ModelRunner:
    """Device side of the engine for one model and one ``KVCacheConfig``.

    Args:
      model: an NNX model with the ``models`` paged-forward interface.
      kv_cache_config: the plan; buffers are allocated here.
      max_num_seqs, max_num_batched_tokens, max_model_len: the scheduler's limits.
      attention_backend: "auto" | "xla" | "cpu" | "pallas" | "reference".
      cache_dtype: KV-cache dtype name ("float32", "bfloat16", "float16", "fp8").
      seed: engine seed for requests without their own.
      mesh: a ``"tp"`` mesh for tensor parallelism (``jaxkv.models.sharding``), or None (one device);
        ``kv_cache_config`` is then one device's plan (its own KV heads).
    """

    def __init__(self, model, kv_cache_config: KVCacheConfig, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, attention_backend: str = "auto",
                 cache_dtype: str = "float32", seed: int = 0, eos_token_id: int | None = None, k_scale: float | None = None,
                 v_scale: float | None = None, min_token_bucket: int = 16, min_seq_bucket: int = 1,
                 speculative_config: SpeculativeConfig | None = None,
                 logprobs_mode: str = "raw_logprobs",
                 mesh=None,
                 ):
        self.config = kv_cache_config
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = kv_cache_config.block_size
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self.vocab_size = model.config.vocab_size
        backend, interpret = resolve_backend(attention_backend, head_size=model.config.head_dim,
                                             block_size=self.block_size)
        self.backend = backend
        self.binding = KVCacheBinding(
            layers=tuple((name, g, t) for name, (g, t) in kv_cache_config.layer_binding().items()),
            block_size=self.block_size, cache_dtype=cache_dtype, backend=backend,
            interpret=interpret, k_scale=k_scale, v_scale=v_scale, mesh=mesh)
        self.page_bytes = kv_memory.page_size_bytes(kv_cache_config)

        self.graphdef, self.state = nnx.split(model)
        if mesh is not None:   # tensor parallel: weights split by models.sharding's rules
            self.state = shard_state(self.state, mesh, getattr(model, "tp_partition_rules", None))
        self.mesh = mesh
        self.placement = HostPlacement(mesh)   # host inputs / results, one process or SPMD
        self.buffers = kv_memory.allocate_kv_buffers(kv_cache_config, mesh=mesh)
        self.max_blocks_per_req = cdiv(max_model_len, self.block_size)
        self.input_batch = InputBatch(max_num_seqs, max_model_len,
                                      [self.max_blocks_per_req] * self.num_groups, engine_seed=seed)
        self.stager = self.input_batch.block_table
        self.tables = self.stager.device_tables(self.placement.to_device)
        self.last_sampled = self.placement.zeros(max_num_seqs, jnp.int32)   # [R] the last step's tokens by row
        self._in_flight: StepHandle | None = None   # dispatched, not yet collected
        self.eos_token_id = eos_token_id
        self.speculative_config = speculative_config
        k = speculative_config.num_speculative_tokens if speculative_config is not None else 0
        # scored positions of a step with drafts: rows + drafts, a power of two (few compiles)
        self.spec_buckets = pow2_buckets(1, max_num_seqs * (k + 1))
        self.num_draft_tokens = 0       # drafts scored, and of those accepted (vLLM's spec metrics)
        self.num_accepted_tokens = 0

        self.token_buckets = token_buckets(min(min_token_bucket, max_num_batched_tokens), max_num_batched_tokens)
        self.seq_buckets = pow2_buckets(min(min_seq_bucket, max_num_seqs), max_num_seqs)
        # The step's shape depends on (T, S) and the sampling flags only: its block-table diff
        # has a fixed capacity (one move, clear and write per row: any decode step) and its
        # list of pages to zero a capacity set by T and S (zero_capacity). A step that needs
        # more (new or resumed rows writing many blocks) applies them before the step, with
        # small jitted updates of their own.
        per_step = max_num_seqs * self.num_groups
        self._ops_layout = BlockTableOpsLayout(
            num_moves=max_num_seqs, num_clears=max_num_seqs, num_writes=per_step)
        self.zero_buckets = pow2_buckets(per_step, max(per_step, self.config.num_blocks))
        self._zero_pages = jax.jit(   # pages beyond a step's capacity, zeroed before it
            functools.partial(kv_memory.zero_blocks_all, page_bytes=self.page_bytes,
                              cpu_kernel=self.binding.cpu_kernels, mesh=mesh), donate_argnums=0)

        self.requests: dict[str, CachedRequestState] = {}
        #: ``jaxkv.worker.kv_connector.ConnectorHooks`` when a KV connector is set (Worker).
        self.kv_connector_hooks = None
        self._handling: str | None = None   # the request being set up (named if it raises)
        self._out_specs: dict = {}
        self.logprobs_mode = logprobs_mode
        self._step = self.jit_step(self.binding)
        self.compiled_shapes: set[StepShape] = set()
        self.num_compiles = 0
        self.compile_seconds = 0.0

    def jit_step(self, binding: KVCacheBinding):
        """The jitted step for ``binding`` (the runner's own, or another: ``jaxkv.gpu_aot``
        compiles the GPU kernels' variant for a GPU this machine does not have)."""
        k = self.speculative_config.num_speculative_tokens if self.speculative_config is not None else 0
        mode = self.logprobs_mode
        step = build_step_fn(self.graphdef, binding=binding, page_bytes=self.page_bytes,
                             sample_fn=functools.partial(sample_fn, logprobs_mode=mode),
                             prompt_logprobs_fn=prompt_logprobs_fn, out_specs=self._out_specs,
                             spec_sample_fn=functools.partial(spec_sample_fn, logprobs_mode=mode),
                             gather_rows=functools.partial(gather_rows, max_drafts=k))
        return jax.jit(step, static_argnames=("shape",), donate_argnames=("buffers", "tables", "last_sampled"))

    # ---- persistent batch ---------------------------------------------------------------------

    def _add_to_batch(self, s: CachedRequestState) -> None:
        self.input_batch.add_request(
            s.req_id, s.token_ids[: s.num_prompt_tokens], s.block_ids, s.sampling_params,
            output_token_ids=s.token_ids[s.num_prompt_tokens:],
            num_computed_tokens=s.num_computed_tokens)

    def _update_states(self, so: SchedulerOutput) -> list[int]:
        """Applies the scheduler's decisions to the persistent batch; returns block ids to zero.

        As vLLM: finished requests are forgotten; preempted and unscheduled ones leave the
        batch but keep their state; new and resumed ones take free rows (a resumed request's
        block lists are replaced); running ones get their new blocks appended; then the batch
        is condensed so rows 0..n-1 are exactly this step's requests.
        """
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        for req_id in so.preempted_req_ids:
            batch.remove_request(req_id)
        for req_id in batch.req_ids:
            if req_id not in so.num_scheduled_tokens:
                batch.remove_request(req_id)
        try:
            self._add_new_and_cached(so)
        except BaseException as exc:
            blame(exc, self._handling)
            raise
        batch.condense()
        return list(so.new_block_ids_to_zero)

    def _add_new_and_cached(self, so: SchedulerOutput) -> None:
        """``_update_states`` for the scheduled requests (``_handling``: the one at hand)."""
        batch = self.input_batch
        for new in so.scheduled_new_reqs:
            self._handling = new.req_id
            s = CachedRequestState(
                req_id=new.req_id, token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids), sampling_params=new.sampling_params,
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens)
            if new.pooling_params is not None:
                s.pooling = PoolAccumulator(new.pooling_params, len(new.prompt_token_ids))
            self.requests[new.req_id] = s
            self._add_to_batch(s)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._handling = req_id
            s = self.requests[req_id]
            s.num_computed_tokens = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i]
            resumed = cached.resumed_from_preemption[i]
            if resumed:
                s.block_ids = [list(ids) for ids in new_ids]
                if req_id in cached.all_token_ids:   # the core's tokens: a token sampled by a
                    s.token_ids = list(cached.all_token_ids[req_id])   # step in flight at the
                    # preemption was dropped there, and is sampled again
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    s.block_ids[g].extend(ids)
            row = batch.req_id_to_index.get(req_id)
            if row is not None and not resumed:
                batch.num_computed_tokens_cpu[row] = s.num_computed_tokens
                if new_ids is not None and any(new_ids):
                    batch.append_block_ids(req_id, new_ids)
            else:
                batch.remove_request(req_id)
                self._add_to_batch(s)
        self._handling = None

    # ---- one step -----------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step and returns its sampled tokens (``collect(dispatch(so))``)."""
        return self.collect(self.dispatch(so))

    def dispatch(self, so: SchedulerOutput) -> StepHandle | None:
        """Updates the batch, builds the inputs and starts the step on the device; None when
        nothing is scheduled. Tokens sampled by the step in flight (dispatched, not collected)
        are read on the device (the penalties count them there too)."""
        zero_ids = self._update_states(so)
        hooks = self.kv_connector_hooks
        if hooks is not None:   # loads land before the step (their pages are not in zero_ids)
            hooks.before_step(so)
        batch = self.input_batch
        req_ids = batch.req_ids
        n = len(req_ids)
        if n == 0 or so.total_num_scheduled_tokens == 0:
            if self.stager.has_pending_ops():
                self._flush_block_table_ops()
            if zero_ids:   # a step with nothing scheduled still hands out blocks (remote loads)
                self._zero_now(zero_ids)
            return None
        prev = self._in_flight
        states = [self.requests[r] for r in req_ids]
        q_lens = np.array([so.num_scheduled_tokens[r] for r in req_ids], np.int32)
        total = int(q_lens.sum())
        S = pick_bucket(n, self.seq_buckets)
        # A pure-decode step has one token per row: T = S, so its shapes are the warmed ones.
        T = S if total == n else pick_bucket(total, self.token_buckets)
        num_computed = np.zeros(S, np.int32)
        num_computed[:n] = batch.num_computed_tokens_cpu[:n]
        qsl = np.zeros(S + 1, np.int32)
        qsl[1 : n + 1] = np.cumsum(q_lens)
        qsl[n + 1 :] = total
        # Each row's tokens [c, c + q) from its host row; a token sampled by the step in
        # flight (pending, not on the host yet) is read on the device from that step's row.
        c = num_computed[:n]
        known = batch.num_tokens[:n]                       # tokens on the host per row
        rows = np.repeat(np.arange(n), q_lens)             # [total] row of each token
        offset = np.arange(total) - np.repeat(qsl[:n], q_lens)
        input_ids = np.zeros(T, np.int32)
        spec = so.scheduled_spec_decode_tokens
        drafts = [list(spec.get(r, ())) for r in req_ids]
        num_drafts = np.array([len(d) for d in drafts], np.int32)
        for i in np.flatnonzero(num_drafts).tolist():   # drafts follow the row's known tokens
            batch.token_ids_cpu[i, known[i]: known[i] + num_drafts[i]] = drafts[i]
        input_ids[:total] = batch.token_ids_cpu[rows, np.repeat(c, q_lens) + offset]
        prev_rows = np.full(T, -1, np.int32)
        pending = np.zeros(n, np.int32)
        if prev is not None:
            src = np.array([prev.sample_rows.get(r, -1) for r in req_ids], np.int32)
            pending = (src >= 0).astype(np.int32)
            reads = np.flatnonzero((src >= 0) & (c + q_lens > known))   # input at position `known`
            prev_rows[qsl[reads] + known[reads] - c[reads]] = src[reads]
        ends = c + q_lens
        if np.any(ends > known + pending + num_drafts):
            i = int(np.argmax(ends > known + pending + num_drafts))
            raise RuntimeError(f"request {req_ids[i]!r}: {ends[i]} tokens scheduled, {known[i]} known")
        samples = ends >= known + pending
        pool_rows = [i for i, st in enumerate(states) if st.pools_now]
        pooling = POOL_NONE
        if pool_rows:   # pooling rows return hidden states and never a token
            samples[pool_rows] = False
            pooling = POOL_ALL if any(states[i].pooling.params.pooling_type == "ALL"
                                      for i in pool_rows) else POOL_ROWS
        ops, ops_layout, zeros = self._table_ops_and_zeros(zero_ids, T, S)
        md = batch.sampling_metadata(S, eos_token_id=self.eos_token_id, vocab_size=self.vocab_size,
                                     num_pending=pending)
        k_prompt = prompt_logprobs.top_k(states)
        extra = {"prev_rows": prev_rows}
        if k_prompt >= 0:
            extra["prompt_targets"] = prompt_logprobs.targets(states, qsl, q_lens, T)
        spec_start = None
        if num_drafts.any():
            spec_inputs, spec_start = self._spec_inputs(qsl, drafts, S)
            extra.update(spec_inputs)
        max_q_len = 1 if int(q_lens.max()) == 1 else T
        shape, packed = self._pack_step(
            input_ids, qsl, num_computed, n, ops, ops_layout, zeros, md, extra,
            max_q_len=max_q_len,
            prompt_logprobs=bucket_k(k_prompt) if k_prompt > 0 else k_prompt,
            spec_positions=len(extra["spec_index"]) if spec_start is not None else 0,
            pooling=pooling)
        out = self._dispatch(shape, packed)
        if hooks is not None:   # saves read the buffers the step returned
            hooks.after_dispatch()
        prompt_rows = [i for i, st in enumerate(states) if prompt_logprobs.wants(st)] if k_prompt >= 0 else []
        batch.num_computed_tokens_cpu[:n] = ends   # progress advances at dispatch, as in the core
        for st, end in zip(states, ends.tolist()):
            st.num_computed_tokens = end
        handle = StepHandle(shape=shape, out=out, states=states, q_lens=q_lens, qsl=qsl,
                            computed=c, samples=samples, prompt_rows=prompt_rows,
                            sample_rows={req_ids[i]: i for i in np.flatnonzero(samples).tolist()},
                            drafts=drafts, spec_start=spec_start, pool_rows=pool_rows)
        self._in_flight = handle
        return handle

    def collect(self, handle: StepHandle | None) -> ModelRunnerOutput:
        """Waits for a dispatched step and appends its sampled tokens (to rows still in the
        batch, and to each request's state)."""
        hooks = self.kv_connector_hooks
        if handle is None:
            out = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
            if hooks is not None:
                out.kv_connector_output = hooks.output()
            return out
        if self._in_flight is handle:
            self._in_flight = None
        results = self._fetch(handle.shape, handle.out)
        try:
            out = self._collect_rows(handle, results)
        except BaseException as exc:
            blame(exc, self._handling)
            raise
        finally:
            self._handling = None
        if hooks is not None:
            out.kv_connector_output = hooks.output()
        return out

    def _collect_rows(self, handle: StepHandle, results: dict[str, np.ndarray]) -> ModelRunnerOutput:
        """``collect`` after the fetch: per row, its tokens, logprobs and pooled vectors."""
        batch = self.input_batch
        sampled = results["sampled_token_ids"]   # [S], or [P] with drafts
        accepted = results.get("spec_accepted")   # [P] bool with drafts
        start = handle.spec_start if handle.spec_start is not None else np.arange(len(handle.states))
        want_lp = "logprobs" in results
        out_tokens: list[list[int]] = []
        logprobs_out: list | None = [] if want_lp else None
        prompt_lp: dict = {}
        toks = sampled.tolist()
        samples = handle.samples.tolist()
        index = batch.req_id_to_index
        rows, row_toks = [], []
        spec_out = [] if self.speculative_config is not None else None
        propose = spec_out is not None and batch_may_speculate(self.speculative_config, len(handle.states))
        for i in handle.prompt_rows:
            s = handle.states[i]
            self._handling = s.req_id
            prompt_lp[s.req_id] = prompt_logprobs.collect(
                s, results, int(handle.qsl[i]), int(handle.q_lens[i]), int(handle.computed[i]))
        pooled = {}
        for i in handle.pool_rows:
            s = handle.states[i]
            self._handling = s.req_id
            vec = s.pooling.add(results, i, int(handle.qsl[i]), int(handle.q_lens[i]), int(handle.computed[i]))
            if vec is not None:
                pooled[s.req_id] = vec
        for i, s in enumerate(handle.states):
            self._handling = s.req_id
            if samples[i]:
                new = self._accepted_tokens(toks, accepted, int(start[i]), handle.drafts[i] if handle.drafts else ())
                s.token_ids.extend(new)
                row = index.get(s.req_id)
                if row is not None:
                    rows.append(row)
                    row_toks.append(new)
                out_tokens.append(new)
                if want_lp:   # one entry per new token: its position's logprobs
                    k = s.sampling_params.logprobs
                    logprobs_out.append([row_logprobs(results, int(start[i]) + j, k) for j in range(len(new))]
                                        if k is not None else [])
            else:                                # a partial prefill chunk: nothing sampled
                out_tokens.append([])
                if want_lp:
                    logprobs_out.append([])
            if spec_out is not None:
                spec_out.append(self._propose(s) if propose and samples[i] else [])
        self._handling = None
        for r in range(max(map(len, row_toks), default=0)):   # the r-th new token of each row
            sel = [j for j, t in enumerate(row_toks) if len(t) > r]
            batch.append_one_token_per_row(np.asarray([rows[j] for j in sel]),
                                           np.asarray([row_toks[j][r] for j in sel], np.int32))
        req_ids = handle.req_ids
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=out_tokens, logprobs=logprobs_out,
                                 prompt_logprobs_dict=prompt_lp, spec_token_ids=spec_out,
                                 pooler_output=pooled)

    def _accepted_tokens(self, tokens: list[int], accepted, start: int, drafts) -> list[int]:
        new = accepted_tokens(tokens, accepted, start, drafts)
        if drafts:
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += len(new) - 1
        return new

    def _propose(self, s: CachedRequestState) -> list[int]:
        return propose_drafts(self.speculative_config, s.token_ids, getattr(s.sampling_params, "max_tokens", None),
                              s.num_generated, self.max_model_len)

    def _spec_inputs(self, qsl: np.ndarray, drafts: list[list[int]], S: int
                     ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        return spec_step_inputs(qsl, drafts, S, self.spec_buckets)

    def _pack_step(self, input_ids, qsl, num_computed, n, ops, ops_layout, zeros, md, extra, *,
                   max_q_len, prompt_logprobs, spec_positions: int = 0,
                   pooling: int = POOL_NONE) -> tuple[StepShape, np.ndarray]:
        leaves, treedef = jax.tree_util.tree_flatten(md)
        arrays = {"input_ids": input_ids, "query_start_loc": qsl, "num_computed": num_computed,
                  "num_seqs": np.array([n], np.int32), "block_ops": ops, "zero_blocks": zeros}
        arrays.update({f"sampling_{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)})
        arrays.update(extra)
        packed, spec = pack(arrays)
        shape = StepShape(num_tokens=input_ids.shape[0], num_seqs=num_computed.shape[0],
                          width=self.max_blocks_per_req,
                          max_q_len=max_q_len, inputs=spec,
                          ops=ops_layout, sampling_treedef=treedef,
                          prompt_logprobs=prompt_logprobs, spec_positions=spec_positions,
                          pooling=pooling)
        return shape, packed

    def zero_capacity(self, T: int, S: int) -> int:
        """Pages a step of T tokens over S rows zeroes in the step (a ``zero_buckets`` size).

        A row's q new tokens need at most ceil(q / bs) new blocks per group, so a step needs at
        most groups * min(T, T // bs + S): S for a decode step (T = S), T // bs + S for a
        prefill. More (blocks handed out to requests the same schedule then preempted) are
        zeroed before the step.
        """
        need = self.num_groups * min(T, T // self.block_size + S)
        return pick_bucket(min(need, self.zero_buckets[-1]), self.zero_buckets)

    def _table_ops_and_zeros(self, zero_ids: Sequence[int], T: int, S: int):
        """The step's block-table diff (fixed layout) and pages to zero ([zero_capacity] int32,
        -1 padded); what does not fit is applied to the device state first."""
        moves, clears, writes = self.stager.encode_sizes()
        base = self._ops_layout
        if moves > base.num_moves or clears > base.num_clears or writes > base.num_writes:
            self._flush_block_table_ops()
        ops, layout = self.stager.encode(base)
        cap = self.zero_capacity(T, S)
        if len(zero_ids) > cap:
            self._zero_now(zero_ids)
            zero_ids = ()
        zeros = np.full(cap, -1, np.int32)
        zeros[: len(zero_ids)] = zero_ids
        return ops, layout, zeros

    def _zero_now(self, zero_ids: Sequence[int]) -> None:
        """Zeroes pages outside a step (a small jitted update, one compile per bucket)."""
        ids = np.full(pick_bucket(len(zero_ids), self.zero_buckets), -1, np.int32)
        ids[: len(zero_ids)] = zero_ids
        self.buffers = self._zero_pages(self.buffers, self.placement.to_device(ids))

    def _empty_step(self, T: int, S: int, *, max_q_len: int, sampling=None,
                    num_output_tokens: int = 0, spec_positions: int = 0,
                    pooling: int = POOL_NONE) -> tuple[StepShape, np.ndarray]:
        """Shape and inputs of a step of T tokens and S rows with no request in it: greedy, or
        with the sampling flags of one row of ``sampling`` (SamplingParams) that has
        ``num_output_tokens`` outputs (only its flags matter: no row is scheduled); with
        ``spec_positions`` P, a step that scores P positions against drafts (none here)."""
        if sampling is None:
            md = build_sampling_metadata([], np.zeros((0, 2), np.uint32), [], [], [], num_rows=S)
        else:
            md = build_sampling_metadata([sampling], np.zeros((1, 2), np.uint32),
                                         [num_output_tokens], [[]], [0], num_rows=S,
                                         eos_token_id=self.eos_token_id, vocab_size=self.vocab_size)
        ops, layout, zeros = self._table_ops_and_zeros((), T, S)
        extra = {"prev_rows": np.full(T, -1, np.int32)}
        if spec_positions:
            extra.update(spec_padding(spec_positions, S))
        return self._pack_step(np.zeros(T, np.int32), np.zeros(S + 1, np.int32),
                               np.zeros(S, np.int32), 0, ops, layout, zeros, md, extra,
                               max_q_len=max_q_len, prompt_logprobs=-1,
                               spec_positions=spec_positions, pooling=pooling)

    def step_shapes(self, *, prefill: bool) -> list[tuple[int, int, int]]:
        """(T, S, max_q_len) of the greedy steps ``warmup`` compiles: the pure-decode step of
        every request bucket (T = S), and with ``prefill`` every (token bucket, request
        bucket) pair a step with prefill tokens can take (its n rows hold more than n tokens,
        at most T)."""
        shapes = [(S, S, 1) for S in self.seq_buckets]
        if prefill:
            for T in self.token_buckets:
                for i, S in enumerate(self.seq_buckets):
                    if i == 0 or self.seq_buckets[i - 1] + 1 < T:   # the bucket's least n < T
                        shapes.append((T, S, T))
        return shapes

    def spec_step_shapes(self) -> list[tuple[int, int, int]]:
        """(T, S, P) of the decode steps with drafts: n rows in request bucket S, at least one
        with a draft, score t = n + drafts positions (n < t <= n (k + 1), t within the token
        budget); such a step has T = token bucket of t and P = positions bucket of t. Empty
        without speculative decoding. Example: 64 rows, k = 3, budget 2048 -> 28 shapes."""
        if self.speculative_config is None:
            return []
        k = self.speculative_config.num_speculative_tokens
        shapes, prev = [], 0
        for S in self.seq_buckets:
            for t in range(prev + 2, min(S * (k + 1), self.max_num_batched_tokens) + 1):
                shape = (pick_bucket(t, self.token_buckets), S, pick_bucket(t, self.spec_buckets))
                if shape not in shapes:
                    shapes.append(shape)
            prev = S
        return shapes

    def warmup(self, *, progress: bool = True, prefill: bool = False, sampling=()) -> None:
        """Compiles the greedy steps of ``step_shapes(prefill=prefill)``: by default the
        pure-decode step of every request bucket, so steady-state greedy decoding never
        compiles (attention walks each sequence's own blocks in a loop, so the context length
        is not part of the shape); with ``prefill`` every prefill / mixed step too (many more
        shapes), so no greedy step compiles later. With speculative decoding, also every
        decode step with drafts (``spec_step_shapes``).

        ``sampling`` (SamplingParams) adds each one's variant of those shapes: its flags, and
        with ``min_tokens`` both the variant that bans stop ids and the one after it. A batch
        mixing greedy rows with such rows takes the same variant.
        """
        variants = [(None, 0)]
        for p in sampling:
            variants.append((p, 0))
            if getattr(p, "min_tokens", 0):
                variants.append((p, p.min_tokens))
        jobs = [((T, S, q, 0), v) for T, S, q in self.step_shapes(prefill=prefill) for v in variants]
        jobs += [((T, S, T, P), v) for T, S, P in self.spec_step_shapes() for v in variants]
        t0 = time.perf_counter()
        for k, ((T, S, max_q_len, P), (params, outputs)) in enumerate(jobs):
            shape, packed = self._empty_step(T, S, max_q_len=max_q_len, sampling=params,
                                             num_output_tokens=outputs, spec_positions=P)
            if shape not in self.compiled_shapes:
                self._run(shape, packed)
            if progress:
                print(f"\rjaxkv: compiling step shapes {k + 1}/{len(jobs)} "
                      f"({time.perf_counter() - t0:.1f} s)", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)

    def _flush_block_table_ops(self) -> None:
        """Applies the staged block-table ops outside the step (nothing scheduled, or more ops
        than the step's fixed layout holds): a small jitted update, one compile per layout."""
        ops, layout = self.stager.encode()
        self.tables = apply_block_table_ops_jit(self.tables, self.placement.to_device(ops), layout=layout)

    def _dispatch(self, shape: StepShape, packed: np.ndarray) -> jax.Array:
        """Starts the jitted step (a new shape compiles first, timed as a compile)."""
        new = shape not in self.compiled_shapes
        t0 = time.perf_counter()
        self.buffers, self.tables, self.last_sampled, out = self._step(
            self.state, self.buffers, self.tables, self.last_sampled, self.placement.to_device(packed), shape=shape)
        if new:
            out.block_until_ready()
            self.compiled_shapes.add(shape)
            self.num_compiles += 1
            self.compile_seconds += time.perf_counter() - t0
        return out

    def _fetch(self, shape: StepShape, out: jax.Array) -> dict[str, np.ndarray]:
        """The step's results on the host (waits for the device)."""
        return unpack_host(self.placement.to_host(out), self._out_specs[shape])

    def _run(self, shape: StepShape, packed: np.ndarray) -> dict[str, np.ndarray]:
        return self._fetch(shape, self._dispatch(shape, packed))

    # ---- failure recovery ---------------------------------------------------------------------

    def recover_after_failure(self, req_ids) -> bool:
        """Makes the worker consistent after a failed step; returns True when the KV buffers
        had to be re-created (their contents are lost: every request must be recomputed).

        ``req_ids`` (the aborted requests) are forgotten; the step in flight is dropped.
        Every row leaves the persistent batch and the device block tables are rebuilt from
        the (now empty) host mirror, since the failed step may or may not have applied its
        diff; the surviving requests keep their state and take rows again when next
        scheduled (as unscheduled requests do). KV buffers, block tables and the last
        sampled tokens that a failed call had donated are re-created.
        """
        self._in_flight = None
        self._handling = None
        for req_id in req_ids:
            self.requests.pop(req_id, None)
        self.input_batch.clear()
        self.tables = self.stager.device_tables(self.placement.to_device)
        if _lost(self.last_sampled):
            self.last_sampled = self.placement.zeros(self.max_num_seqs, jnp.int32)
        if any(_lost(b) for b in self.buffers):
            self.buffers = kv_memory.allocate_kv_buffers(self.config, mesh=self.mesh)
            return True
        return False

    # ---- warm-up and introspection ------------------------------------------------------------

    def device_block_tables(self) -> list[np.ndarray]:
        """The device tables fetched to the host (tests compare them with the scheduler)."""
        return [self.placement.to_host(t) for t in self.tables]

    def row_of(self, req_id: str) -> int:
        return self.input_batch.req_id_to_index[req_id]
