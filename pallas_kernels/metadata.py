"""AttentionMetadata: the boundary between the model runner, the model and the kernels.

Glossary of dimension names used in shape comments across jaxkv:
  T   num_tokens        tokens in the step, padded to a bucket
  S   max_num_seqs      sequence (request) rows in the step, padded to a bucket
  B   max_blocks        width of a block table row (blocks per sequence)
  N   num_blocks        pages in a KV-cache buffer
  bs  block_size        tokens per page
  Hq  num_q_heads, Hkv num_kv_heads, G = Hq // Hkv (query heads per KV head), D head_dim
"""

from __future__ import annotations

import dataclasses

import jax

#: Slot id of a token that must write nothing (vLLM's PAD_SLOT_ID). Writers map it to an
#: out-of-range index and scatter with mode="drop" (JAX wraps -1 to the last slot otherwise).
PAD_SLOT_ID = -1
#: Block id 0 is the null block: never handed out, stands for "no block" in tables.
NULL_BLOCK_ID = 0


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step, per-KV-cache-group inputs of paged attention.

    Sequences are packed: sequence i owns query tokens ``[query_start_loc[i], query_start_loc[i+1])``
    which are the *last* ``q_len_i`` of its ``seq_lens[i]`` tokens. Padding sequences have
    ``q_len = 0`` and ``seq_len = 0``; padding tokens (index >= query_start_loc[-1]) have
    ``slot_mapping == PAD_SLOT_ID`` and produce zeros.

    Example (bs 4): seq 0 has 5 cached tokens and 2 new ones, seq 1 is a new 3-token prompt:
      query_start_loc = [0, 2, 5], seq_lens = [7, 3], positions = [5, 6, 0, 1, 2],
      block_tables = [[7, 3], [2, 0]] -> slot_mapping = [13, 14, 8, 9, 10].
    """

    seq_lens: jax.Array  # [S] int32, KV length including this step's tokens; 0 = padding
    query_start_loc: jax.Array  # [S + 1] int32, non-decreasing, query_start_loc[0] == 0
    block_tables: jax.Array  # [S, B] int32, this group's block ids (NULL_BLOCK_ID = unused)
    slot_mapping: jax.Array  # [T] int32, block * bs + offset per token; PAD_SLOT_ID = no write
    num_seqs: jax.Array  # [] int32, real sequences (rows >= num_seqs are padding)
    max_q_len: int = (
        0  # static: an upper bound on any q_len this step (1 = pure decode); 0 = unknown (T)
    )

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["seq_lens", "query_start_loc", "block_tables", "slot_mapping", "num_seqs"],
    meta_fields=["max_q_len"],
)
