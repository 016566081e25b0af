"""Device side: flat KV buffers, device block tables, the persistent batch, the jitted step, the sampler."""

from jaxkv.worker.block_table import BlockTableOpsLayout, BlockTableStager, apply_block_table_ops
from jaxkv.worker.input_batch import InputBatch
from jaxkv.worker.kv_memory import (
    allocate_kv_buffers,
    page_size_bytes,
    read_blocks,
    write_blocks,
    zero_blocks,
)
from jaxkv.worker.model_runner import ModelRunner, resolve_backend
from jaxkv.worker.sampler import SamplerOutput, compute_logprobs, sample
from jaxkv.worker.sampling_metadata import (
    SamplingMetadata,
    build_sampling_metadata,
    make_request_key,
    make_unseeded_request_key,
)
from jaxkv.worker.step import slot_mapping, token_positions
