"""Device block tables: staged host ops, encoded diffs, and the jitted on-device apply."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxkv.worker.block_table import (
    PAD_ROW,
    BlockTableOpsLayout,
    BlockTableStager,
    apply_block_table_ops_jit,
)


def _step(stager, tables, layout=None):
    """Encodes the staged diff, applies it on the device (tables donated), returns new tables."""
    ops, layout = stager.encode(layout)
    assert ops.dtype == np.int32 and ops.shape == (layout.size,)
    return apply_block_table_ops_jit(tables, ops, layout=layout)


def _assert_synced(stager, tables):
    for g, (host, dev) in enumerate(zip(stager.tables, tables)):
        np.testing.assert_array_equal(np.asarray(dev), host, err_msg=f"group {g}")


def test_literal_scenario_two_groups():
    # Two groups (e.g. full attention and sliding window) of widths 4 and 3, 4 rows.
    s = BlockTableStager(max_num_reqs=4, max_num_blocks_per_req=[4, 3], min_bucket=2)
    tables = s.device_tables()

    # Step 1: three new requests.
    s.add_row(0, [[5, 6], [20]])
    s.add_row(1, [[7], [21]])
    s.add_row(2, [[8, 9], [22, 23]])
    tables = _step(s, tables)
    _assert_synced(s, tables)
    assert s.tables[0].tolist() == [[5, 6, 0, 0], [7, 0, 0, 0], [8, 9, 0, 0], [0, 0, 0, 0]]
    assert s.tables[1].tolist() == [[20, 0, 0], [21, 0, 0], [22, 23, 0], [0, 0, 0]]
    assert s.num_blocks_per_row.tolist() == [[2, 1, 2, 0], [1, 1, 2, 0]]
    assert s.max_num_blocks_in_use() == 2 and s.max_num_blocks_in_use(group=1) == 2

    # Step 2: row 0 finishes; row 2 is condensed into it and grows; row 1 grows; a new
    # request lands in the vacated row 2 -- all in one step.
    s.clear_row(0)
    s.move_row(2, 0)
    s.append_row(0, [[11], []])
    s.append_row(1, [[12, 13], [24]])
    s.add_row(2, [[14], [25]])
    ops, layout = s.encode()
    # Net effect: one move (2 -> 0) reading row 2 as it was at the start of the step; a clear
    # of row 2 (vacated, and non-empty at the start); writes for rows 0, 1 and 2. Row 0's own
    # clear disappears: the move replaces its whole content.
    m2 = 2 * layout.num_moves
    moves = ops[:m2].reshape(-1, 2)
    clears = ops[m2 : m2 + layout.num_clears]
    writes = ops[m2 + layout.num_clears :].reshape(-1, 4)
    assert moves.tolist() == [[2, 0], [PAD_ROW, PAD_ROW]]
    assert clears.tolist() == [2, PAD_ROW]
    real_writes = [w for w in writes.tolist() if w[1] != PAD_ROW]
    assert real_writes == [
        [0, 0, 2, 11],
        [0, 1, 1, 12],
        [0, 1, 2, 13],
        [1, 1, 1, 24],
        [0, 2, 0, 14],
        [1, 2, 0, 25],
    ]
    tables = apply_block_table_ops_jit(tables, ops, layout=layout)
    _assert_synced(s, tables)
    assert s.tables[0].tolist() == [[8, 9, 11, 0], [7, 12, 13, 0], [14, 0, 0, 0], [0, 0, 0, 0]]
    assert s.tables[1].tolist() == [[22, 23, 0], [21, 24, 0], [25, 0, 0], [0, 0, 0]]

    # Step 3: swap-like chain of moves (1 -> 3, 0 -> 1) and a clear of a moved-out row.
    s.move_row(1, 3)
    s.move_row(0, 1)
    tables = _step(s, tables)
    _assert_synced(s, tables)
    assert s.tables[0].tolist() == [[0, 0, 0, 0], [8, 9, 11, 0], [14, 0, 0, 0], [7, 12, 13, 0]]
    assert s.num_blocks_per_row.tolist() == [[0, 3, 1, 3], [0, 2, 1, 2]]

    # Step 4: nothing staged -> an all-padding diff changes nothing.
    assert not s.has_pending_ops()
    tables = _step(s, tables)
    _assert_synced(s, tables)


def test_padding_writes_nothing():
    # Padding entries are PAD_ROW = -1; JAX would wrap -1 to the LAST row, so check it is intact.
    s = BlockTableStager(max_num_reqs=3, max_num_blocks_per_req=[2], min_bucket=4)
    s.add_row(2, [[9, 8]])
    tables = _step(s, s.device_tables())
    layout = BlockTableOpsLayout(num_moves=4, num_clears=4, num_writes=4)
    ops, _ = s.encode(layout)
    assert (ops[: 2 * 4 + 4] == PAD_ROW).all()
    tables = apply_block_table_ops_jit(tables, ops, layout=layout)
    assert np.asarray(tables[0]).tolist() == [[0, 0], [0, 0], [9, 8]]


def test_errors():
    s = BlockTableStager(max_num_reqs=2, max_num_blocks_per_req=[2])
    with pytest.raises(ValueError, match="exceed the table width 2"):
        s.add_row(0, [[1, 2, 3]])
    with pytest.raises(ValueError, match="out of range"):
        s.clear_row(2)
    with pytest.raises(ValueError, match="1 groups"):
        s.append_row(0, [[1], [2]])
    s.add_row(0, [[1]])
    s.add_row(1, [[2]])
    with pytest.raises(ValueError, match="too small"):
        s.encode(BlockTableOpsLayout(num_moves=0, num_clears=0, num_writes=1))


class BlockTableMachine(RuleBasedStateMachine):
    """Random add / append / move / clear ops over many steps; device == host mirror each step.

    An independent reference (a list of block-id lists per row) is replayed call by call, so
    the mirror itself is checked too.
    """

    R, WIDTHS = 5, (4, 2)

    @initialize()
    def setup(self):
        self.stager = BlockTableStager(self.R, self.WIDTHS, min_bucket=2)
        self.tables = self.stager.device_tables()
        self.ref = [[[] for _ in range(self.R)] for _ in self.WIDTHS]  # [group][row] -> ids
        self.next_id = 1

    def _ids(self, n):
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    @rule(row=st.integers(0, R - 1), data=st.data())
    def add_row(self, row, data):
        ids = [self._ids(data.draw(st.integers(0, w))) for w in self.WIDTHS]
        self.stager.add_row(row, ids)
        for g in range(len(self.WIDTHS)):
            self.ref[g][row] = list(ids[g])

    @rule(row=st.integers(0, R - 1), data=st.data())
    def append_row(self, row, data):
        ids = [
            self._ids(data.draw(st.integers(0, w - len(self.ref[g][row]))))
            for g, w in enumerate(self.WIDTHS)
        ]
        self.stager.append_row(row, ids)
        for g in range(len(self.WIDTHS)):
            self.ref[g][row] += ids[g]

    @rule(src=st.integers(0, R - 1), dst=st.integers(0, R - 1))
    def move_row(self, src, dst):
        self.stager.move_row(src, dst)
        if src != dst:
            for g in range(len(self.WIDTHS)):
                self.ref[g][dst], self.ref[g][src] = self.ref[g][src], []

    @rule(row=st.integers(0, R - 1))
    def clear_row(self, row):
        self.stager.clear_row(row)
        for g in range(len(self.WIDTHS)):
            self.ref[g][row] = []

    @precondition(lambda self: hasattr(self, "stager"))
    @rule()
    def step(self):
        self.tables = _step(self.stager, self.tables)
        _assert_synced(self.stager, self.tables)

    @invariant()
    def mirror_matches_reference(self):
        if not hasattr(self, "stager"):
            return
        for g, w in enumerate(self.WIDTHS):
            expected = np.zeros((self.R, w), np.int32)
            for row, ids in enumerate(self.ref[g]):
                expected[row, : len(ids)] = ids
            np.testing.assert_array_equal(self.stager.tables[g], expected)
            assert self.stager.num_blocks_per_row[g].tolist() == [len(r) for r in self.ref[g]]

    def teardown(self):
        if hasattr(self, "stager"):
            self.step()


BlockTableMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, derandomize=True
)
test_block_table_state_machine = BlockTableMachine.TestCase


def test_apply_is_in_place():
    # With the tables donated, the diff is applied in place: the tables alias the outputs and
    # the temporaries are the moved rows, not a copy of a table.
    s = BlockTableStager(max_num_reqs=256, max_num_blocks_per_req=[1024, 1024])
    s.add_row(3, [[1, 2], [3]])
    s.move_row(3, 7)
    s.clear_row(9)
    ops, layout = s.encode()
    tables = tuple(jnp.zeros((256, 1024), jnp.int32) for _ in range(2))
    mem = apply_block_table_ops_jit.lower(tables, ops, layout=layout).compile().memory_analysis()
    table_bytes = 2 * 256 * 1024 * 4
    assert mem.alias_size_in_bytes == table_bytes
    assert mem.temp_size_in_bytes < table_bytes // 8, mem.temp_size_in_bytes
