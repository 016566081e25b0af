"""Device side: flat KV buffers, device block tables, the persistent batch, the compiled programs, the sampler."""

from jaxkv.worker.backends import BACKENDS, resolve_backend
from jaxkv.worker.block_table import BlockTableOpsLayout, BlockTableStager, apply_block_table_ops
from jaxkv.worker.forward import ForwardInputs, slot_mapping, token_positions
from jaxkv.worker.input_batch import InputBatch
from jaxkv.worker.kv_memory import (
    allocate_kv_buffers,
    page_size_bytes,
    read_blocks,
    write_blocks,
    zero_blocks,
)
from jaxkv.worker.model_runner import ModelRunner
from jaxkv.worker.program_set import ProgramKey, ProgramSet, num_programs, program_keys
from jaxkv.worker.sampler import SamplerOutput, SamplingRows, sample
from jaxkv.worker.sampling_state import SamplingState, SamplingStateUpdate
from jaxkv.worker.sampling_updates import make_request_key, make_unseeded_request_key
