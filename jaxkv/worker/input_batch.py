"""The persistent input batch: request rows kept across steps on the host (vLLM ``InputBatch``).

Each running request owns one row ``0 <= row < max_num_reqs`` of every per-request array,
here and in the device block tables (kept in sync through :class:`BlockTableStager`, whose
staged diff is applied on the device each step). A new request takes the lowest free row;
removing one leaves a hole; :meth:`InputBatch.condense` closes the holes by moving the last
rows into them, so that after it the rows ``0..num_reqs-1`` are exactly the live requests.

Shape names: ``R`` = max_num_reqs, ``Lmax`` = max_model_len.

Example: add a, b, c -> rows 0, 1, 2. Remove a -> hole at 0. Add d -> row 0 (lowest free).
Remove b -> hole at 1; condense -> c moves 2 -> 1 (``move_row(2, 1)`` is staged on the block
tables), and ``req_ids == ["d", "c"]``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.block_table import BlockTableStager
from jaxkv.worker.sampling_updates import make_request_key, make_unseeded_request_key


class InputBatch:
    """Host-side per-row request state plus the staged device block-table diff.

    Args:
      max_num_reqs: rows (R).
      max_model_len: longest request (prompt + output) in tokens (Lmax).
      max_num_blocks_per_req: block-table width per KV-cache group.
      engine_seed: seeds the keys of requests without ``SamplingParams.seed``.
      min_bucket: passed to :class:`BlockTableStager`.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_blocks_per_req: Sequence[int],
        *,
        engine_seed: int = 0,
        min_bucket: int = 8,
    ):
        if max_num_reqs <= 0 or max_model_len <= 0:
            raise ValueError(
                f"max_num_reqs and max_model_len must be positive, got {max_num_reqs}, {max_model_len}"
            )
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.engine_seed = engine_seed
        self.block_table = BlockTableStager(
            max_num_reqs, max_num_blocks_per_req, min_bucket=min_bucket
        )

        self._req_ids: list[str | None] = [None] * max_num_reqs  # row -> request id
        self.req_id_to_index: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs))  # min-heap of free rows

        self.token_ids_cpu = np.zeros(
            (max_num_reqs, max_model_len), np.int32
        )  # [R, Lmax] prompt+output
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int32)  # [R]
        self.num_tokens = np.zeros(max_num_reqs, np.int32)  # [R] prompt + output so far
        self.num_computed_tokens_cpu = np.zeros(
            max_num_reqs, np.int32
        )  # [R] tokens with KV in cache
        self.request_keys = np.zeros((max_num_reqs, 2), np.uint32)  # [R, 2] threefry key data
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs  # [R]

    # ---- membership ----------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Live request ids in row order (after :meth:`condense`, position == row)."""
        return [r for r in self._req_ids if r is not None]

    @property
    def is_condensed(self) -> bool:
        return all(r is not None for r in self._req_ids[: self.num_reqs])

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        block_ids_per_group: Sequence[Sequence[int]],
        sampling_params: SamplingParams | None = None,
        *,
        output_token_ids: Sequence[int] = (),
        num_computed_tokens: int = 0,
        request_key: np.ndarray | None = None,  # [2] uint32; default from seed / engine seed
    ) -> int:
        """Puts a new or resumed request in the lowest free row and returns that row.

        A resumed request passes its outputs so far and its *full* block lists (they replace
        the row, as in vLLM). Its key defaults to ``make_request_key(seed)`` if seeded, else
        ``make_unseeded_request_key(engine_seed, req_id)``; both are stable across re-adds.
        """
        if req_id in self.req_id_to_index:
            raise ValueError(
                f"request {req_id!r} is already in the batch (row {self.req_id_to_index[req_id]})"
            )
        if not self._free_rows:
            raise ValueError(f"the batch is full ({self.max_num_reqs} rows); cannot add {req_id!r}")
        num_prompt, num_tokens = (
            len(prompt_token_ids),
            len(prompt_token_ids) + len(output_token_ids),
        )
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {req_id!r} has {num_tokens} tokens, more than max_model_len={self.max_model_len}"
            )
        params = sampling_params if sampling_params is not None else SamplingParams()
        if request_key is None:
            seed = getattr(params, "seed", None)
            request_key = (
                make_request_key(seed)
                if seed is not None
                else make_unseeded_request_key(self.engine_seed, req_id)
            )

        self.block_table.add_row(self._free_rows[0], block_ids_per_group)  # validates first
        row = heapq.heappop(self._free_rows)
        self._req_ids[row] = req_id
        self.req_id_to_index[req_id] = row
        self.token_ids_cpu[row, :num_prompt] = prompt_token_ids
        self.token_ids_cpu[row, num_prompt:num_tokens] = output_token_ids
        self.num_prompt_tokens[row] = num_prompt
        self.num_tokens[row] = num_tokens
        self.num_computed_tokens_cpu[row] = num_computed_tokens
        self.request_keys[row] = request_key
        self.sampling_params[row] = params
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Removes a request (finished, aborted or unscheduled); returns its row, or None.

        The row's block-table entries are cleared (staged), so unused rows are all null.
        """
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self._req_ids[row] = None
        self.sampling_params[row] = None
        self.num_prompt_tokens[row] = self.num_tokens[row] = self.num_computed_tokens_cpu[row] = 0
        self.block_table.clear_row(row)
        heapq.heappush(self._free_rows, row)
        return row

    def clear(self) -> None:
        """Removes every request and resets the block-table mirror (nothing staged)."""
        self._req_ids = [None] * self.max_num_reqs
        self.req_id_to_index = {}
        self._free_rows = list(range(self.max_num_reqs))
        self.sampling_params = [None] * self.max_num_reqs
        for arr in (self.num_prompt_tokens, self.num_tokens, self.num_computed_tokens_cpu):
            arr[:] = 0
        self.block_table.reset()

    def condense(self) -> list[tuple[int, int]]:
        """Moves the last rows into the holes below ``num_reqs``; returns the (src, dst) moves.

        Holes are filled in ascending order, each by the highest occupied row (vLLM order).
        Each move is also staged on the block tables.
        """
        moves = []
        holes = sorted(r for r in self._free_rows if r < self.num_reqs)
        last = self.max_num_reqs - 1
        for hole in holes:
            while self._req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            moves.append((last, hole))
            last -= 1
        self._free_rows = list(range(self.num_reqs, self.max_num_reqs))  # sorted = a valid heap
        return moves

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self._req_ids[src]
        n = int(self.num_tokens[src])
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        for arr in (
            self.num_prompt_tokens,
            self.num_tokens,
            self.num_computed_tokens_cpu,
            self.request_keys,
        ):
            arr[dst] = arr[src]
            arr[src] = 0
        self.sampling_params[dst], self.sampling_params[src] = self.sampling_params[src], None
        self._req_ids[dst], self._req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = dst
        self.block_table.move_row(src, dst)

    # ---- per-step updates ------------------------------------------------------------------

    def append_block_ids(
        self, req_id: str, new_block_ids_per_group: Sequence[Sequence[int]]
    ) -> None:
        """A running request's newly allocated blocks (staged as an append on the tables)."""
        self.block_table.append_row(self.req_id_to_index[req_id], new_block_ids_per_group)

    def append_one_token_per_row(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Appends ``token_ids[i]`` to row ``rows[i]`` (distinct rows; [n] int each)."""
        ends = self.num_tokens[rows]
        if ends.size and int(ends.max()) >= self.max_model_len:
            row = int(rows[int(np.argmax(ends))])
            raise ValueError(
                f"request {self._req_ids[row]!r} would have {int(ends.max()) + 1} tokens "
                f"> max_model_len={self.max_model_len}"
            )
        self.token_ids_cpu[rows, ends] = token_ids
        self.num_tokens[rows] = ends + 1

    def num_output_tokens(self, row: int) -> int:
        return int(self.num_tokens[row] - self.num_prompt_tokens[row])

    def prompt_token_ids(self, row: int) -> np.ndarray:  # [num_prompt_tokens] int32 (a view)
        return self.token_ids_cpu[row, : self.num_prompt_tokens[row]]

    def output_token_ids(self, row: int) -> np.ndarray:  # [num_output_tokens] int32 (a view)
        return self.token_ids_cpu[row, self.num_prompt_tokens[row] : self.num_tokens[row]]
