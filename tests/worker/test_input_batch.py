"""Persistent input batch: rows, holes, condense, and the block tables kept in sync."""

import numpy as np
import pytest

from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.block_table import apply_block_table_ops_jit
from jaxkv.worker.input_batch import InputBatch
from jaxkv.worker.sampling_updates import make_request_key, make_unseeded_request_key


def _rows(batch, group=0):
    return batch.block_table.tables[group].tolist()


def test_add_remove_condense_literal():
    # 4 rows, max_model_len 16, two groups of widths 4 and 2.
    b = InputBatch(max_num_reqs=4, max_model_len=16, max_num_blocks_per_req=[4, 2], engine_seed=3)
    dev = b.block_table.device_tables()

    def sync():
        nonlocal dev
        ops, layout = b.block_table.encode()
        dev = apply_block_table_ops_jit(dev, ops, layout=layout)
        for host, d in zip(b.block_table.tables, dev):
            np.testing.assert_array_equal(np.asarray(d), host)

    # Step 1: a, b, c land in rows 0, 1, 2.
    assert b.add_request("a", [1, 2, 3], [[10], [20]], SamplingParams(seed=5)) == 0
    assert b.add_request("b", [4, 5], [[11], [21]]) == 1
    assert b.add_request("c", [6, 7, 8, 9, 10], [[12, 13], [22]], num_computed_tokens=4) == 2
    sync()
    assert b.req_ids == ["a", "b", "c"] and b.num_reqs == 3
    assert b.req_id_to_index == {"a": 0, "b": 1, "c": 2}
    assert _rows(b) == [[10, 0, 0, 0], [11, 0, 0, 0], [12, 13, 0, 0], [0, 0, 0, 0]]
    assert b.num_tokens.tolist() == [3, 2, 5, 0] and b.num_computed_tokens_cpu.tolist() == [
        0,
        0,
        4,
        0,
    ]
    assert b.request_keys[0].tolist() == make_request_key(5).tolist()
    assert b.request_keys[1].tolist() == make_unseeded_request_key(3, "b").tolist()

    # Step 2: a finishes (hole at 0); d takes the lowest free row, 0; b and c decode.
    assert b.remove_request("a") == 0
    assert b.remove_request("zzz") is None
    assert b.add_request("d", [30, 31], [[14], [23]]) == 0
    b.append_one_token_per_row(np.array([1]), np.array([50], np.int32))  # b is row 1
    b.append_block_ids("c", [[15], [24]])
    assert b.condense() == []  # no holes
    sync()
    assert b.req_ids == ["d", "b", "c"]
    assert _rows(b) == [[14, 0, 0, 0], [11, 0, 0, 0], [12, 13, 15, 0], [0, 0, 0, 0]]
    assert _rows(b, 1) == [[23, 0], [21, 0], [22, 24], [0, 0]]
    assert b.output_token_ids(1).tolist() == [50] and b.prompt_token_ids(1).tolist() == [4, 5]

    # Step 3: e joins (row 3); d and b leave -> holes 0, 1; condense moves 3 -> 0 and 2 -> 1.
    b.add_request("e", [40], [[16], [25]], output_token_ids=[41, 42])  # resumed, with outputs
    b.remove_request("d")
    b.remove_request("b")
    assert not b.is_condensed
    assert b.condense() == [(3, 0), (2, 1)]
    sync()
    assert b.req_ids == ["e", "c"] and b.req_id_to_index == {"e": 0, "c": 1}
    assert _rows(b) == [[16, 0, 0, 0], [12, 13, 15, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert _rows(b, 1) == [[25, 0], [22, 24], [0, 0], [0, 0]]
    assert b.num_tokens.tolist() == [3, 5, 0, 0] and b.num_prompt_tokens.tolist() == [1, 5, 0, 0]
    assert b.num_computed_tokens_cpu.tolist() == [0, 4, 0, 0]
    assert b.token_ids_cpu[0, :3].tolist() == [40, 41, 42]
    assert b.token_ids_cpu[1, :5].tolist() == [6, 7, 8, 9, 10]
    assert b.num_output_tokens(0) == 2
    assert b.request_keys[0].tolist() == make_unseeded_request_key(3, "e").tolist()
    assert b.block_table.max_num_blocks_in_use() == 3

    # Step 4: the next add goes to row 2 (lowest free after condense).
    assert b.add_request("f", [1], [[17], [26]]) == 2
    sync()


def test_errors():
    b = InputBatch(max_num_reqs=1, max_model_len=4, max_num_blocks_per_req=[2])
    with pytest.raises(ValueError, match="max_model_len=4"):
        b.add_request("x", [1, 2, 3, 4, 5], [[1]])
    with pytest.raises(ValueError, match="table width 2"):
        b.add_request("x", [1], [[1, 2, 3]])
    assert b.num_reqs == 0 and not b.block_table.has_pending_ops()
    b.add_request("x", [1], [[1]])
    with pytest.raises(ValueError, match="already in the batch"):
        b.add_request("x", [1], [[1]])
    with pytest.raises(ValueError, match="full"):
        b.add_request("y", [1], [[2]])
    b.append_one_token_per_row(np.array([0]), np.array([7], np.int32))
    b.append_one_token_per_row(np.array([0]), np.array([8], np.int32))
    b.append_one_token_per_row(np.array([0]), np.array([9], np.int32))
    with pytest.raises(ValueError, match="request 'x' would have 5 tokens > max_model_len=4"):
        b.append_one_token_per_row(np.array([0]), np.array([10], np.int32))
    assert b.token_ids_cpu[0].tolist() == [1, 7, 8, 9] and b.num_tokens[0] == 4
