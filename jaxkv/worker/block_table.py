"""Device-resident block tables, updated on the device from a small per-step diff.

One ``[max_num_reqs, B_g]`` int32 table per KV-cache group ``g`` lives on the device for the
whole run. Every step the host stages row operations on a :class:`BlockTableStager` (which
keeps a numpy mirror of every table), encodes their net effect into one flat int32 array, and
the jitted step applies it with :func:`apply_block_table_ops`. Tables are never rebuilt from
the host; the diff is a few hundred bytes a step.

Shape names (see ``jaxkv.pallas_kernels.metadata``): ``R`` = max_num_reqs (rows of the persistent
batch), ``B_g`` = max blocks per request of group g, ``M`` / ``C`` / ``W`` = move / clear /
write capacity of one encoded diff (bucketed).

Row operations (host, in call order, vLLM ``BlockTable`` names):
  ``add_row(row, ids_per_group)``     reset the row, then write ``ids`` from column 0
  ``append_row(row, ids_per_group)``  write ``ids`` at the row's current length
  ``move_row(src, dst)``              dst takes src's content; src becomes empty
  ``clear_row(row)``                  the row becomes empty (all ``NULL_BLOCK_ID``)

Encoded diff, applied on the device in this fixed order:
  1. moves   ``[M, 2]`` (src, dst): ``table[dst] = old_table[src]`` for all moves at once
             (a gather of the rows as they were at the start of the step, then a scatter);
  2. clears  ``[C]``: ``table[row] = NULL_BLOCK_ID``;
  3. writes  ``[W, 4]`` (group, row, col, block_id): ``tables[group][row, col] = block_id``.
Moves come first because they read the start-of-step rows: a vacated source row is then
cleared in step 2 of the same diff, and a row reset after being moved out is a clear plus
writes. The stager does not replay the staged calls; it tracks, for every row, the
start-of-step row its content came from (or "empty") and the cells written since, and encodes
exactly that, so applying the three phases reproduces the host mirror for any call sequence.

Example (one group, B = 4): rows start as ``0: [5, 6]``, ``1: [7]``, ``2: [8, 9]``. The host
stages ``clear_row(0)``, ``move_row(2, 0)``, ``append_row(0, [11])``, ``add_row(2, [12])``.
Net effect: row 0 = start row 2 + write at col 2, row 2 = empty + write at col 0. Encoded:
moves ``[(2, 0)]``, clears ``[2]``, writes ``[(0, 0, 2, 11), (0, 2, 0, 12)]``; result
``0: [8, 9, 11]``, ``1: [7]``, ``2: [12]``.

Padding entries use ``PAD_ROW`` (-1). JAX wraps negative indices (``x.at[-1]`` is the last
row), so the decoder maps ``PAD_ROW`` to the table height and scatters with ``mode="drop"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.pallas_kernels.metadata import NULL_BLOCK_ID
from jaxkv.worker.buckets import pow2_at_least

#: Row index of a padding entry in an encoded diff (moves, clears, writes). It writes nothing.
PAD_ROW = -1
_WRITE_FIELDS = 4  # (group, row, col, block_id)
_MOVE_FIELDS = 2  # (src, dst)


@dataclasses.dataclass(frozen=True)
class BlockTableOpsLayout:
    """Static shape of one encoded diff; hashable, so it can be a jit static argument.

    The flat int32 array is ``[moves (2 * num_moves) | clears (num_clears) |
    writes (4 * num_writes)]``, row-major within each part.
    """

    num_moves: int  # M
    num_clears: int  # C
    num_writes: int  # W

    def __post_init__(self):
        for name in ("num_moves", "num_clears", "num_writes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")

    @property
    def size(self) -> int:
        """Length of the flat int32 encoding."""
        return _MOVE_FIELDS * self.num_moves + self.num_clears + _WRITE_FIELDS * self.num_writes


def apply_block_table_ops(
    tables: tuple[jax.Array, ...],  # per group g: [R, B_g] int32
    ops_flat: jax.Array,  # [layout.size] int32, from BlockTableStager.encode()
    *,
    layout: BlockTableOpsLayout,
) -> tuple[jax.Array, ...]:  # per group g: [R, B_g] int32
    """Applies one encoded diff: moves, then clears, then writes (see the module docstring).

    Pure and jittable; ``layout`` must be static. With the tables donated every phase is an
    in-place scatter (the moved rows are gathered first, so moves read start-of-step rows).
    """
    if ops_flat.shape != (layout.size,):
        raise ValueError(
            f"ops_flat has shape {ops_flat.shape}, layout {layout} needs ({layout.size},)"
        )
    ops_flat = ops_flat.astype(jnp.int32)
    m2 = _MOVE_FIELDS * layout.num_moves
    moves = ops_flat[:m2].reshape(layout.num_moves, _MOVE_FIELDS)  # [M, 2]
    clears = ops_flat[m2 : m2 + layout.num_clears]  # [C]
    writes = ops_flat[m2 + layout.num_clears :].reshape(layout.num_writes, _WRITE_FIELDS)  # [W, 4]

    out = []
    for g, table in enumerate(tables):
        num_rows = table.shape[0]

        def to_index(
            rows, num_rows=num_rows
        ):  # PAD_ROW (negative) -> out of range, dropped by the scatters
            return jnp.where(rows < 0, num_rows, rows)

        if layout.num_moves:
            src = jnp.clip(moves[:, 0], 0, num_rows - 1)  # padding gathers row 0, then drops
            moved = table[src]  # [M, B_g]
            table = table.at[to_index(moves[:, 1])].set(moved, mode="drop")
        if layout.num_clears:
            table = table.at[to_index(clears)].set(NULL_BLOCK_ID, mode="drop")
        if layout.num_writes:
            rows = jnp.where(writes[:, 0] == g, to_index(writes[:, 1]), num_rows)
            table = table.at[rows, writes[:, 2]].set(writes[:, 3], mode="drop")
        out.append(table)
    return tuple(out)


def _encode(moves, clears, writes, layout: BlockTableOpsLayout) -> np.ndarray:
    """(src, dst) moves, cleared rows and (group, row, col, id) writes, padded to ``layout``:
    ``[layout.size]`` int32."""
    move_arr = np.full((layout.num_moves, _MOVE_FIELDS), PAD_ROW, np.int32)
    move_arr[: len(moves)] = np.asarray(moves, np.int32).reshape(-1, _MOVE_FIELDS)
    clear_arr = np.full((layout.num_clears,), PAD_ROW, np.int32)
    clear_arr[: len(clears)] = clears
    write_arr = np.zeros((layout.num_writes, _WRITE_FIELDS), np.int32)
    write_arr[:, 1] = PAD_ROW
    write_arr[: len(writes)] = np.asarray(writes, np.int32).reshape(-1, _WRITE_FIELDS)
    return np.concatenate([move_arr.ravel(), clear_arr, write_arr.ravel()])


@dataclasses.dataclass
class _RowDiff:
    """Net effect of this step's staged ops on one row."""

    origin: int  # start-of-step row whose content this row holds, or PAD_ROW for "empty"
    writes: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (g, col) -> id


class BlockTableStager:
    """Host side of the device block tables: a numpy mirror plus the staged diff of one step.

    Args:
      max_num_reqs: rows (R) of every table.
      max_num_blocks_per_req: width B_g of each group's table (one entry per KV-cache group).
      min_bucket: smallest capacity of each part of an encoded diff; capacities are powers of
        two at least this large, so the jitted step sees few layouts.
    """

    def __init__(
        self, max_num_reqs: int, max_num_blocks_per_req: Sequence[int], *, min_bucket: int = 8
    ):
        if max_num_reqs <= 0 or not max_num_blocks_per_req or min(max_num_blocks_per_req) <= 0:
            raise ValueError(
                f"need max_num_reqs > 0 and positive widths per group, got max_num_reqs="
                f"{max_num_reqs}, max_num_blocks_per_req={list(max_num_blocks_per_req)}"
            )
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = tuple(int(b) for b in max_num_blocks_per_req)
        self.min_bucket = min_bucket
        #: Host mirror, per group: [R, B_g] int32. Equals the device tables after each encode().
        self.tables = [
            np.full((max_num_reqs, b), NULL_BLOCK_ID, np.int32) for b in self.max_num_blocks_per_req
        ]
        #: Blocks in use per row, per group: [G, R] int32.
        self.num_blocks_per_row = np.zeros((self.num_groups, max_num_reqs), np.int32)
        self._start_num_blocks = self.num_blocks_per_row.copy()  # [G, R] at the start of the step
        self._diff: dict[int, _RowDiff] = {}  # row -> net effect; rows absent are unchanged

    @property
    def num_groups(self) -> int:
        return len(self.max_num_blocks_per_req)

    # ---- staging (updates the mirror immediately) -------------------------------------------

    def _row_diff(self, row: int) -> _RowDiff:
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"row {row} out of range [0, {self.max_num_reqs})")
        return self._diff.setdefault(row, _RowDiff(origin=row))

    def _check_groups(self, block_ids_per_group: Sequence[Sequence[int]]) -> None:
        if len(block_ids_per_group) != self.num_groups:
            raise ValueError(
                f"expected block ids for {self.num_groups} groups, got {len(block_ids_per_group)}"
            )

    def clear_row(self, row: int) -> None:
        """The row becomes empty (all NULL_BLOCK_ID) in every group."""
        diff = self._row_diff(row)
        diff.origin, diff.writes = PAD_ROW, {}
        for table in self.tables:
            table[row] = NULL_BLOCK_ID
        self.num_blocks_per_row[:, row] = 0

    def append_row(self, row: int, block_ids_per_group: Sequence[Sequence[int]]) -> None:
        """Writes each group's new block ids at that group's current row length."""
        self._check_groups(block_ids_per_group)
        diff = self._row_diff(row)
        for g, ids in enumerate(block_ids_per_group):
            start, end = (
                int(self.num_blocks_per_row[g, row]),
                int(self.num_blocks_per_row[g, row]) + len(ids),
            )
            if end > self.max_num_blocks_per_req[g]:
                raise ValueError(
                    f"row {row} group {g}: {start} + {len(ids)} blocks exceed the table width "
                    f"{self.max_num_blocks_per_req[g]}"
                )
            self.tables[g][row, start:end] = ids
            self.num_blocks_per_row[g, row] = end
            for col, block_id in enumerate(ids, start):
                diff.writes[(g, col)] = int(block_id)

    def add_row(self, row: int, block_ids_per_group: Sequence[Sequence[int]]) -> None:
        """A new or resumed request: the row is reset and holds exactly these block ids."""
        self._check_groups(block_ids_per_group)
        for g, ids in enumerate(block_ids_per_group):
            if len(ids) > self.max_num_blocks_per_req[g]:
                raise ValueError(
                    f"row {row} group {g}: {len(ids)} blocks exceed the table width "
                    f"{self.max_num_blocks_per_req[g]}"
                )
        self.clear_row(row)
        self.append_row(row, block_ids_per_group)

    def move_row(self, src: int, dst: int) -> None:
        """dst takes src's content (every group); src becomes empty."""
        if src == dst:
            self._row_diff(src)  # range check only
            return
        src_diff, dst_diff = self._row_diff(src), self._row_diff(dst)
        dst_diff.origin, dst_diff.writes = src_diff.origin, dict(src_diff.writes)
        for table in self.tables:
            table[dst] = table[src]
        self.num_blocks_per_row[:, dst] = self.num_blocks_per_row[:, src]
        self.clear_row(src)

    # ---- queries -----------------------------------------------------------------------------

    def max_num_blocks_in_use(self, group: int | None = None) -> int:
        """Widest row in use (in one group, or over all groups), for slicing tables to a bucket."""
        counts = self.num_blocks_per_row if group is None else self.num_blocks_per_row[group]
        return int(counts.max(initial=0))

    def has_pending_ops(self) -> bool:
        return bool(self._diff)

    # ---- encoding ----------------------------------------------------------------------------

    def _net_ops(self) -> tuple[list, list, list]:
        """The staged diff as (moves [(src, dst)], clears [row], writes [(g, row, col, id)])."""
        moves, clears, writes = [], [], []
        for row in sorted(self._diff):
            diff = self._diff[row]
            if diff.origin == PAD_ROW:
                if self._start_num_blocks[:, row].any():  # rows with 0 blocks are already all NULL
                    clears.append(row)
            elif diff.origin != row:
                moves.append((diff.origin, row))
            writes.extend(
                (g, row, col, block_id) for (g, col), block_id in sorted(diff.writes.items())
            )
        return moves, clears, writes

    def encode_sizes(self) -> tuple[int, int, int]:
        """(moves, clears, writes) the next :meth:`encode` needs, to pick a layout beforehand."""
        moves, clears, writes = self._net_ops()
        return len(moves), len(clears), len(writes)

    def encode(
        self, layout: BlockTableOpsLayout | None = None
    ) -> tuple[np.ndarray, BlockTableOpsLayout]:
        """Encodes the net effect of the ops staged since the last encode, and starts a new step.

        Args:
          layout: capacities to pad to; by default the smallest power-of-two buckets
            (>= ``min_bucket``) that fit. A given layout that is too small raises ValueError.

        Returns:
          ``(ops_flat, layout)``: ``ops_flat`` is ``[layout.size]`` int32 (pack it with the other
          step inputs), ``layout`` is the static argument of :func:`apply_block_table_ops`.
        """
        moves, clears, writes = self._net_ops()

        if layout is None:
            layout = BlockTableOpsLayout(
                num_moves=pow2_at_least(len(moves), self.min_bucket),
                num_clears=pow2_at_least(len(clears), self.min_bucket),
                num_writes=pow2_at_least(len(writes), self.min_bucket),
            )
        elif (
            len(moves) > layout.num_moves
            or len(clears) > layout.num_clears
            or len(writes) > layout.num_writes
        ):
            raise ValueError(
                f"diff needs {len(moves)} moves, {len(clears)} clears, {len(writes)} writes; "
                f"layout {layout} is too small"
            )
        self._diff.clear()
        self._start_num_blocks = self.num_blocks_per_row.copy()
        return _encode(moves, clears, writes, layout), layout

    def encode_chunks(self, layout: BlockTableOpsLayout) -> list[np.ndarray]:
        """:meth:`encode` for a fixed ``layout`` whatever the diff's size: the moves, the clears
        and the first ``layout.num_writes`` writes in the first encoding, the other writes in
        further ones (applied after it, in order; writes are plain assignments, so splitting
        them changes nothing). At least one encoding; ValueError when the moves or clears do
        not fit (a layout with ``max_num_reqs`` of each always fits them)."""
        moves, clears, writes = self._net_ops()
        if len(moves) > layout.num_moves or len(clears) > layout.num_clears:
            raise ValueError(
                f"diff needs {len(moves)} moves and {len(clears)} clears; layout {layout} "
                f"holds {layout.num_moves} and {layout.num_clears}"
            )
        w = layout.num_writes
        if writes and not w:
            raise ValueError(f"diff needs {len(writes)} writes; layout {layout} holds none")
        parts = [writes[i : i + w] for i in range(0, len(writes), w)]
        chunks = []
        for i, part in enumerate(parts or [[]]):
            chunks.append(_encode(moves if i == 0 else [], clears if i == 0 else [], part, layout))
        self._diff.clear()
        self._start_num_blocks = self.num_blocks_per_row.copy()
        return chunks

    def reset(self) -> None:
        """Every row empty and nothing staged (after a failed step; pair it with fresh
        ``device_tables()``, since the device may not have applied the last diff)."""
        for table in self.tables:
            table[:] = NULL_BLOCK_ID
        self.num_blocks_per_row[:] = 0
        self._start_num_blocks[:] = 0
        self._diff.clear()

    def device_tables(self, put=jnp.asarray) -> tuple[jax.Array, ...]:
        """Fresh device copies of the mirror (initialisation and tests; steps use diffs).

        ``put``: how a host table reaches the device (``HostPlacement.to_device`` over a mesh
        that spans processes, where each process passes its own identical mirror)."""
        return tuple(put(t) for t in self.tables)


#: Jitted apply with the tables donated (updated in place); for tests and standalone use.
apply_block_table_ops_jit = jax.jit(
    apply_block_table_ops, static_argnames=("layout",), donate_argnames=("tables",)
)
