"""ModelRunner: turns a ``SchedulerOutput`` into a few compiled programs on the device.

Per step the runner, one module per phase:
  1. updates its persistent batch (request id <-> row and sampling slot,
     ``jaxkv.worker.persistent_batch``) and its device side: the sampling state of requests
     that enter it, block-table ops and pages to zero (``jaxkv.worker.batch_sync``);
  2. prepares the programs' inputs in row order (``jaxkv.worker.input_prep``: one typed record
     per program, packed into one int32 array);
  3. runs the forward (KV buffers and block tables donated) and, chained on the device, the
     head its rows need (``jaxkv.worker.forward``, ``jaxkv.worker.heads``);
  4. fetches the sampled tokens (and logprobs, prompt logprobs or hidden states only when a
     row asked for them) and builds the output (``jaxkv.worker.collect``).

The attention backend, the layers' KV binding and the buffer layout are resolved once
(``jaxkv.worker.backends``). The programs are a small set fixed by the configuration
(``jaxkv.worker.step_programs``, ``jaxkv.worker.program_set``), compiled by ``warmup`` at
start-up; a program compiled later is counted and logged (``ProgramSet.late_compiles``). After
a failed step, device state a failed call took with it is re-created
(``jaxkv.worker.recovery``).

``execute_model`` does all four; with async scheduling the engine calls ``dispatch`` (1-3)
for step N+1 before ``collect`` (4) of step N, so the host prepares a step while the device
runs the one before it. A token sampled by step N that step N+1 needs as input is read on
the device from N's ``last_sampled`` row: the host never waits for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.core import ModelRunnerOutput, SchedulerOutput
from jaxkv.kv_cache import KVCacheConfig, cdiv
from jaxkv.models.sharding import shard_state
from jaxkv.worker import batch_sync, kv_memory
from jaxkv.worker.backends import bind_attention, check_kv_layout
from jaxkv.worker.block_table import BlockTableOpsLayout
from jaxkv.worker.collect import (
    CachedRequestState,
    StepHandle,
    StepOutputs,
    append_tokens,
    collect_rows,
    fetch_results,
)
from jaxkv.worker.heads import LogitsHead
from jaxkv.worker.input_batch import InputBatch
from jaxkv.worker.input_prep import plan_step
from jaxkv.worker.packing import pack_record
from jaxkv.worker.persistent_batch import PersistentBatch
from jaxkv.worker.placement import HostPlacement
from jaxkv.worker.program_set import (
    FORWARD,
    ProgramKey,
    ProgramSet,
    program_keys,
)
from jaxkv.worker.recovery import replace_lost
from jaxkv.worker.sampling_state import allocate_state
from jaxkv.worker.spec_decode import SpeculativeConfig, batch_may_speculate, propose_drafts
from jaxkv.worker.step_programs import (
    buckets_for,
    build_program,
    dispatch_heads,
    forward_dims,
    forward_program,
    state_leaves,
)

#: Entries (a long prompt's history, an allow-list, ...) one sampling-state update carries.
UPDATE_ENTRIES = 2048


class ModelRunner:
    """Device side of the engine for one model and one ``KVCacheConfig``.

    Args:
      model: an NNX model with the ``models`` paged-forward interface.
      kv_cache_config: the plan; buffers are allocated here.
      max_num_seqs, max_num_batched_tokens, max_model_len: the scheduler's limits.
      attention_backend: "auto" | "xla" | "cpu" | "pallas" | "reference".
      cache_dtype: KV-cache dtype name ("float32", "bfloat16", "float16", "fp8").
      seed: engine seed for requests without their own.
      max_logprobs: logprobs a request may ask for (the sampling programs' K; -1: the vocabulary).
      mesh: a ``"tp"`` mesh for tensor parallelism (``jaxkv.models.sharding``), or None (one device);
        ``kv_cache_config`` is then one device's plan (its own KV heads).
    """

    def __init__(
        self,
        model,
        kv_cache_config: KVCacheConfig,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        attention_backend: str = "auto",
        cache_dtype: str = "float32",
        seed: int = 0,
        eos_token_id: int | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        min_token_bucket: int = 16,
        speculative_config: SpeculativeConfig | None = None,
        logprobs_mode: str = "raw_logprobs",
        max_logprobs: int = 20,
        mesh=None,
    ):
        self.config = kv_cache_config
        self.model_config = model.config
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = kv_cache_config.block_size
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self.vocab_size = model.config.vocab_size
        #: kv_layout: "bytes" (flat uint8) | "words" (flat uint32, TPU word tiles): ``kv_memory``.
        self.binding, self.kv_layout = bind_attention(
            attention_backend,
            kv_cache_config,
            head_size=model.config.head_dim,
            cache_dtype=cache_dtype,
            k_scale=k_scale,
            v_scale=v_scale,
            mesh=mesh,
        )
        self.backend = self.binding.backend
        self.page_bytes = kv_memory.page_size_bytes(kv_cache_config)

        self.graphdef, self.state = nnx.split(model)
        if mesh is not None:  # tensor parallel: weights split by models.sharding's rules
            self.state = shard_state(self.state, mesh, getattr(model, "tp_partition_rules", None))
        self._leaves_of, self._state_leaves = None, ()  # state_leaves(self.state), cached
        self.mesh = mesh
        self.placement = HostPlacement(mesh)  # host inputs / results, one process or SPMD
        self.buffers = self._new_buffers()
        self.max_blocks_per_req = cdiv(max_model_len, self.block_size)
        self.persistent = PersistentBatch(
            InputBatch(
                max_num_seqs,
                max_model_len,
                [self.max_blocks_per_req] * self.num_groups,
                engine_seed=seed,
            )
        )
        self.input_batch = self.persistent.input_batch
        self.requests = self.persistent.requests  # req id -> CachedRequestState
        self.slots = self.persistent.slots  # req id <-> sampling-state slot
        self.stager = self.input_batch.block_table
        self.tables = self.stager.device_tables(self.placement.to_device)
        self.last_sampled = self.placement.zeros(
            max_num_seqs, jnp.int32
        )  # [R] the last step's tokens by row
        # Sampling options by slot (max_num_seqs slots + the neutral one), written at entry.
        self.sampling_state = self._new_sampling_state()
        self.neutral_slot = max_num_seqs
        self._in_flight: StepHandle | None = None  # dispatched, not yet collected
        self.eos_token_id = eos_token_id
        self.speculative_config = speculative_config
        self.num_speculative_tokens = (
            speculative_config.num_speculative_tokens if speculative_config else 0
        )
        self.num_draft_tokens = 0  # drafts scored, and of those accepted (vLLM's spec metrics)
        self.num_accepted_tokens = 0
        self.logprobs_mode = logprobs_mode
        self.num_logprobs = (
            self.vocab_size if max_logprobs == -1 else min(max_logprobs, self.vocab_size)
        )

        self.buckets = buckets_for(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_speculative_tokens=self.num_speculative_tokens,
            min_token_bucket=min_token_bucket,
        )
        # A step's block-table diff has a fixed capacity (one move, clear and write per row:
        # any decode step); more writes (new or resumed rows of many blocks) are applied by
        # the table_ops program before the step, in chunks of the same layout.
        self.ops_layout = BlockTableOpsLayout(
            num_moves=max_num_seqs,
            num_clears=max_num_seqs,
            num_writes=max_num_seqs * self.num_groups,
        )
        self.zero_chunk = (
            max_num_seqs * self.num_groups
        )  # pages the zero_pages program zeroes a call
        self.update_slots, self.update_entries = max_num_seqs, UPDATE_ENTRIES
        #: ``jaxkv.worker.kv_connector.ConnectorHooks`` when a KV connector is set (Worker).
        self.kv_connector_hooks = None
        forward = forward_program(self, self.buckets.tokens[0], greedy=False)  # no head yet
        hidden = jax.eval_shape(forward.fn, *forward.abstract_args())[2]  # [T, hidden]
        self.hidden_size, self.hidden_dtype = hidden.shape[1], hidden.dtype
        self.head = LogitsHead(self.graphdef, self.state, self.hidden_size, mesh=mesh)
        self.head_params = self.head.params(self.state)  # the weights never change: picked once
        self.programs = ProgramSet(lambda key: build_program(self, key))

    def use_kv_layout(self, layout: str) -> None:
        """Re-creates the (empty) KV buffers in ``layout`` ("bytes" | "words") before the first
        step, and forgets compiled programs. The platform picks the layout
        (``backends.resolve_kv_layout``); this is for the TPU word layout off a TPU: the Pallas
        backend's interpret mode on CPU, and the deviceless TPU tier (``jaxkv.tpu_aot``)."""
        if self.input_batch.num_reqs or self._in_flight is not None:
            raise RuntimeError("the KV layout can change only before the first step")
        check_kv_layout(
            layout,
            self.backend,
            head_size=self.model_config.head_dim,
            block_size=self.block_size,
            cache_dtype=self.binding.cache_dtype,
        )
        self.kv_layout = layout
        self.buffers = self._new_buffers()
        self.programs = ProgramSet(lambda key: build_program(self, key))

    def _new_buffers(self) -> list[jax.Array]:
        """Fresh (zeroed) KV buffers in the runner's layout."""
        return kv_memory.allocate_kv_buffers(self.config, mesh=self.mesh, layout=self.kv_layout)

    def _new_sampling_state(self):
        """A fresh device sampling state: ``max_num_seqs`` slots and the neutral one."""
        return allocate_state(
            self.max_num_seqs + 1, self.vocab_size, self.max_model_len, put=self.placement.to_device
        )

    # ---- programs -----------------------------------------------------------------------------

    def program_keys(self, *, generate: bool = True) -> list[ProgramKey]:
        """Every program this runner can run (``generate=False``: pooling requests only)."""
        return program_keys(
            token_buckets=self.buckets.tokens,
            seq_buckets=self.buckets.seqs,
            spec_buckets=self.buckets.spec,
            generate=generate,
        )

    def warmup(self, *, progress: bool = True, generate: bool = True) -> None:
        """Compiles every program of ``program_keys``: after it nothing compiles."""
        self.programs.warm_up(self.program_keys(generate=generate), progress=progress)

    @property
    def num_compiles(self) -> int:
        return self.programs.num_compiles

    @property
    def compile_seconds(self) -> float:
        return self.programs.compile_seconds

    # ---- one step -----------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step and returns its sampled tokens (``collect(dispatch(so))``)."""
        return self.collect(self.dispatch(so))

    def _run(self, kind: str, size: int, *args):
        return self.programs(ProgramKey(kind, size), *args)

    def _to_device(self, record) -> jax.Array:
        return self.placement.to_device(pack_record(record)[0])

    def _zero_now(self, zero_ids: Sequence[int]) -> None:
        """Zeroes pages outside a step, ``zero_chunk`` at a time."""
        batch_sync.zero_pages(self, zero_ids)

    def dispatch(self, so: SchedulerOutput) -> StepHandle | None:
        """Updates the batch, builds the inputs and starts the step's programs on the device;
        None when nothing is scheduled."""
        zero_ids = self.persistent.update(so)  # block ids to zero
        hooks = self.kv_connector_hooks
        if hooks is not None:  # loads land before the step (their pages are not in zero_ids)
            hooks.before_step(so)
        batch = self.input_batch
        batch_sync.write_slots(self)
        if batch.num_reqs == 0 or so.total_num_scheduled_tokens == 0:
            batch_sync.sync_without_step(self, zero_ids)
            return None
        prev = self._in_flight
        states = [self.requests[r] for r in batch.req_ids]
        plan = plan_step(
            batch,
            states,
            so,
            prev.sample_rows if prev is not None else None,
            dims_for=lambda t: forward_dims(self, t),
            seq_buckets=self.buckets.seqs,
            spec_buckets=self.buckets.spec,
            slots=self.slots.slot_of,
            neutral_slot=self.neutral_slot,
            num_speculative_tokens=self.num_speculative_tokens,
            max_num_seqs=self.max_num_seqs,
            token_buckets=self.buckets.tokens,
        )
        x = plan.forward
        batch_sync.stage_block_changes(self, x, zero_ids)  # what does not fit goes first
        T = plan.num_tokens
        if self._leaves_of is not self.state:  # the weights as forward[T] takes them
            self._leaves_of, self._state_leaves = self.state, state_leaves(self.state)
        self.buffers, self.tables, hidden, selected, self.last_sampled, tokens = self._run(
            FORWARD,
            T,
            self._state_leaves,
            self.buffers,
            self.tables,
            self.last_sampled,
            self._to_device(x),
        )
        if hooks is not None:  # saves read the buffers the step returned
            hooks.after_dispatch()
        results = dispatch_heads(self, plan, hidden, selected, tokens)
        n = len(states)
        ends = plan.computed + plan.q_lens
        batch.num_computed_tokens_cpu[:n] = ends  # progress advances at dispatch, as in the core
        for st, end in zip(states, ends.tolist()):
            st.num_computed_tokens = end
        handle = StepHandle(
            plan=plan,
            states=states,
            results=results,
            sample_rows={states[i].req_id: i for i in np.flatnonzero(plan.samples).tolist()},
        )
        self._in_flight = handle
        return handle

    def _fetch(self, results: StepOutputs) -> StepOutputs:
        """The step's results on the host (waits for the device)."""
        return fetch_results(results, self.placement.to_host)

    def collect(self, handle: StepHandle | None) -> ModelRunnerOutput:
        """Waits for a dispatched step and appends its sampled tokens (to rows still in the
        batch, and to each request's state)."""
        if handle is None:
            out = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        else:
            if self._in_flight is handle:
                self._in_flight = None
            batch = self.input_batch
            propose = None
            if self.speculative_config is not None:
                may = batch_may_speculate(self.speculative_config, len(handle.states))
                propose = self._propose if may else (lambda s: [])
            got = collect_rows(
                handle, self._fetch(handle.results), row_of=batch.req_id_to_index, propose=propose
            )
            self.num_draft_tokens += got.num_drafts
            self.num_accepted_tokens += got.num_accepted
            append_tokens(batch, got)
            out = got.output
        out.num_compiles = self.programs.num_compiles
        if self.kv_connector_hooks is not None:
            out.kv_connector_output = self.kv_connector_hooks.output()
        return out

    def _propose(self, s: CachedRequestState) -> list[int]:
        return propose_drafts(
            self.speculative_config,
            s.token_ids,
            getattr(s.sampling_params, "max_tokens", None),
            s.num_generated,
            self.max_model_len,
        )

    # ---- failure recovery ---------------------------------------------------------------------

    def recover_after_failure(self, req_ids) -> bool:
        """Makes the worker consistent after a failed step; returns True when the KV buffers
        had to be re-created (their contents are lost: every request must be recomputed).

        ``req_ids`` (the aborted requests) are forgotten; the step in flight is dropped.
        Every row leaves the persistent batch (and its sampling slot) and the device block
        tables are rebuilt from the (now empty) host mirror, since the failed step may or may
        not have applied its diff; the surviving requests keep their state and take rows again
        when next scheduled (as unscheduled requests do). KV buffers, block tables, the last
        sampled tokens and the sampling state that a failed call had donated are re-created.
        """
        self._in_flight = None
        self.persistent.clear(forget=req_ids)
        self.tables = self.stager.device_tables(self.placement.to_device)
        self.last_sampled, _ = replace_lost(
            self.last_sampled, lambda: self.placement.zeros(self.max_num_seqs, jnp.int32)
        )
        self.sampling_state, _ = replace_lost(self.sampling_state, self._new_sampling_state)
        self.buffers, kv_lost = replace_lost(self.buffers, self._new_buffers)
        return kv_lost

    # ---- introspection ------------------------------------------------------------------------

    def device_block_tables(self) -> list[np.ndarray]:
        """The device tables fetched to the host (tests compare them with the scheduler)."""
        return [self.placement.to_host(t) for t in self.tables]

    def row_of(self, req_id: str) -> int:
        return self.input_batch.req_id_to_index[req_id]
