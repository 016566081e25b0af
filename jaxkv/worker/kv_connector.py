"""The KV cache as a KV connector sees it, and the runner's connector hooks.

``PagedKVCaches`` wraps the runner's flat buffers (one per ``KVCacheTensor``; block ``b``
is bytes ``[b * page_bytes, (b + 1) * page_bytes)`` of each; uint8, or uint32 words in the TPU
word layout, whose pages move as uint8 rows all the same: ``kv_memory``). A transfer unit is a
list of block ids; its pages are gathered into one ``[K, page_bytes]`` uint8 array per KV tensor (K
padded to a power of two so few shapes compile; padding ids are -1 and read zeros / write
nothing). With a tensor-parallel mesh each device holds its own KV heads' pages, so the
gathered array is ``[tp * K, page_bytes]`` split over ``"tp"``: device i's rows are its pages.

``ConnectorHooks`` is what ``ModelRunner`` calls: ``before_step`` (bind the step's metadata,
start its loads), ``after_dispatch`` (saves: their reads are ordered after the step by data
dependence) and ``output`` (the step's ``KVConnectorOutput``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.core.outputs import KVConnectorOutput
from jaxkv.models.sharding import TP_AXIS
from jaxkv.worker import kv_memory


def pages_bucket(num_blocks: int) -> int:
    """Rows of a gathered page array for ``num_blocks`` blocks: the next power of two (>= 1)."""
    return 1 << max(0, num_blocks - 1).bit_length()


def _read_all(buffers, ids, *, page_bytes):
    return tuple(kv_memory.read_blocks(b, ids, page_bytes=page_bytes) for b in buffers)


def _write_all(buffers, ids, pages, *, page_bytes):
    return tuple(
        kv_memory.write_blocks(b, ids, p, page_bytes=page_bytes) for b, p in zip(buffers, pages)
    )


class PagedKVCaches:
    """The runner's KV buffers for a connector: page gather / scatter, host conversion.

    Args:
      runner: the ``ModelRunner`` (its ``buffers`` are replaced by every step: always read
        them through this object, never keep one).
    """

    def __init__(self, runner):
        self._runner = runner
        self.kv_cache_config = runner.config
        self.page_bytes = runner.page_bytes
        self.block_size = runner.block_size
        self.mesh = runner.mesh
        self.num_tensors = len(runner.config.kv_cache_tensors)
        self.tp = self.mesh.shape[TP_AXIS] if self.mesh is not None else 1
        read = functools.partial(_read_all, page_bytes=self.page_bytes)
        write = functools.partial(_write_all, page_bytes=self.page_bytes)
        n = self.num_tensors
        if self.mesh is not None:
            shard = PartitionSpec(TP_AXIS)
            read = jax.shard_map(
                read,
                mesh=self.mesh,
                in_specs=((shard,) * n, PartitionSpec()),
                out_specs=(shard,) * n,
                check_vma=False,
            )
            write = jax.shard_map(
                write,
                mesh=self.mesh,
                in_specs=((shard,) * n, PartitionSpec(), (shard,) * n),
                out_specs=(shard,) * n,
                check_vma=False,
            )
            self.page_sharding = NamedSharding(self.mesh, shard)
            pages, ids = self.page_sharding, NamedSharding(self.mesh, PartitionSpec())
        else:
            self.page_sharding = None
            pages = ids = jax.sharding.SingleDeviceSharding(self._device())
        # Shardings spelled out: jit's cache key otherwise holds whether each argument is
        # committed, which differs between the warm-up's arrays (fresh buffers, gathered
        # pages) and a load's (the step's outputs, pages put from the host), and every load
        # compiled the scatter again.
        self.read_fn, self.write_fn = read, write  # unjitted (a compile for another device)
        self._read = jax.jit(read, in_shardings=((pages,) * n, ids), out_shardings=(pages,) * n)
        self._write = jax.jit(
            write,
            in_shardings=((pages,) * n, ids, (pages,) * n),
            out_shardings=(pages,) * n,
            donate_argnums=0,
        )

    @property
    def buffers(self) -> tuple[jax.Array, ...]:
        return self._runner.buffers

    def page_shape(self, num_blocks: int) -> tuple[int, int]:
        """Global shape of one tensor's gathered pages for ``num_blocks`` blocks."""
        return (self.tp * pages_bucket(num_blocks), self.page_bytes)

    def page_specs(self, num_blocks: int) -> list[jax.ShapeDtypeStruct]:
        """What a gather of ``num_blocks`` blocks returns, one per KV tensor (to pull into)."""
        sharding = self.page_sharding or jax.sharding.SingleDeviceSharding(self._device())
        return [
            jax.ShapeDtypeStruct(self.page_shape(num_blocks), np.uint8, sharding=sharding)
            for _ in range(self.num_tensors)
        ]

    def _device(self):
        return next(iter(self.buffers[0].sharding.device_set))

    def _ids(self, block_ids: Sequence[int]) -> jax.Array:
        ids = np.full(pages_bucket(len(block_ids)), -1, np.int32)
        ids[: len(block_ids)] = block_ids
        return self._runner.placement.to_device(ids)

    def read_pages(self, block_ids: Sequence[int]) -> tuple[jax.Array, ...]:
        """Copies of these blocks' pages: per KV tensor ``page_shape(len(block_ids))`` uint8."""
        return self._read(self.buffers, self._ids(block_ids))

    def write_pages(self, block_ids: Sequence[int], pages: Sequence[jax.Array]) -> None:
        """Writes gathered pages (``read_pages``' shapes) into these blocks, in place; an id
        of -1 skips its row."""
        pages = tuple(pages)
        want = self.page_shape(len(block_ids))
        if len(pages) != self.num_tensors or any(
            p.shape != want or p.dtype != np.uint8 for p in pages
        ):
            raise ValueError(
                f"expected {self.num_tensors} uint8 page arrays of shape {want}, got "
                f"{[(p.dtype.name, p.shape) for p in pages]}"
            )
        self._runner.buffers = self._write(self.buffers, self._ids(block_ids), pages)

    def warm_up(self) -> int:
        """Runs the page gather and scatter once per page bucket a transfer can have (powers
        of two up to every block of one request in every group), with ids of -1 (nothing is
        written), so no transfer compiles while the engine works. Returns the buckets run."""
        r = self._runner
        most = pages_bucket(r.num_groups * r.max_blocks_per_req)
        buckets = [1 << i for i in range(most.bit_length())]
        for n in buckets:
            ids = [-1] * n
            self.write_pages(ids, self.read_pages(ids))
        return len(buckets)

    # ---- host copies (one entry per addressable shard: a process of a multi-process mesh
    # holds only its own devices' pages) ---------------------------------------------------------

    def pages_to_host(self, pages: Sequence[jax.Array]) -> dict[str, np.ndarray]:
        """``{"t{tensor}_s{shard}": [K, page_bytes] uint8}`` of this process's shards."""
        out = {}
        for t, arr in enumerate(pages):
            for s in arr.addressable_shards:
                rows = s.index[0]
                shard = (rows.start or 0) // s.data.shape[0] if self.tp > 1 else 0
                out[f"t{t}_s{shard}"] = np.asarray(s.data)
        return out

    def pages_from_host(
        self, host: dict[str, np.ndarray], num_blocks: int
    ) -> tuple[jax.Array, ...]:
        """``pages_to_host``'s inverse for ``num_blocks`` blocks (KeyError / ValueError when the
        host copy is not this layout's)."""
        shape = self.page_shape(num_blocks)
        rows = shape[0] // self.tp
        out = []
        for t in range(self.num_tensors):
            if self.page_sharding is None:
                data = host[f"t{t}_s0"]
                if data.shape != shape:
                    raise ValueError(
                        f"stored pages of tensor {t} have shape {data.shape}, expected {shape}"
                    )
                out.append(jax.device_put(data, self._device()))
                continue
            arrays = []
            for device, index in self.page_sharding.addressable_devices_indices_map(shape).items():
                shard = (index[0].start or 0) // rows
                data = host[f"t{t}_s{shard}"]
                if data.shape != (rows, self.page_bytes):
                    raise ValueError(
                        f"stored pages t{t}_s{shard} have shape {data.shape}, "
                        f"expected {(rows, self.page_bytes)}"
                    )
                arrays.append(jax.device_put(data, device))
            out.append(jax.make_array_from_single_device_arrays(shape, self.page_sharding, arrays))
        return tuple(out)

    # ---- per-device shards (what crosses between processes device to device) ------------------

    def local_shards(self, pages: Sequence[jax.Array]) -> list[jax.Array]:
        """This process's shards of gathered pages as single-device ``[K, page_bytes]`` arrays,
        tensor by tensor, each tensor's in shard order (the order ``shard_specs`` expects)."""
        out = []
        for arr in pages:
            shards = sorted(arr.addressable_shards, key=lambda s: s.index[0].start or 0)
            out.extend(s.data for s in shards)
        return out

    def shard_specs(self, num_blocks: int) -> list[jax.ShapeDtypeStruct]:
        """What ``local_shards`` of a ``num_blocks`` gather looks like (to pull into)."""
        shape = self.page_shape(num_blocks)
        rows = shape[0] // self.tp
        devices = self._local_devices_in_order(shape)
        return [
            jax.ShapeDtypeStruct(
                (rows, self.page_bytes), np.uint8, sharding=jax.sharding.SingleDeviceSharding(d)
            )
            for _ in range(self.num_tensors)
            for d in devices
        ]

    def from_local_shards(
        self, shards: Sequence[jax.Array], num_blocks: int
    ) -> tuple[jax.Array, ...]:
        """``local_shards``' inverse: gathered pages for ``write_pages``."""
        shape = self.page_shape(num_blocks)
        if self.page_sharding is None:
            return tuple(shards)
        per = len(shards) // self.num_tensors
        return tuple(
            jax.make_array_from_single_device_arrays(
                shape, self.page_sharding, list(shards[t * per : (t + 1) * per])
            )
            for t in range(self.num_tensors)
        )

    def _local_devices_in_order(self, shape) -> list:
        if self.page_sharding is None:
            return [self._device()]
        index = self.page_sharding.addressable_devices_indices_map(shape)
        return sorted(index, key=lambda d: index[d][0].start or 0)

    def layout(self) -> dict:
        """What must match for pages to move between two engines (checked by connectors)."""
        c = self.kv_cache_config
        return {
            "page_bytes": self.page_bytes,
            "num_tensors": self.num_tensors,
            "tp": self.tp,
            "block_size": self.block_size,
            "num_groups": len(c.kv_cache_groups),
            "kv_layout": self._runner.kv_layout,
        }  # a page's byte order: kv_memory


class ConnectorHooks:
    """The runner's calls into its worker-side connector around each step."""

    def __init__(self, connector):
        self.connector = connector
        self._finished: set[str] = set()

    def before_step(self, scheduler_output) -> None:
        self._finished = set(scheduler_output.finished_req_ids)
        self.connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        self.connector.start_load_kv()

    def after_dispatch(self) -> None:
        self.connector.wait_for_save()

    def output(self) -> KVConnectorOutput:
        c = self.connector
        sending, recving = c.get_finished(self._finished)
        self._finished = set()
        out = KVConnectorOutput(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            invalid_block_ids=set(c.get_block_ids_with_load_errors()),
            stats=c.get_kv_connector_stats() or {},
        )
        c.clear_connector_metadata()
        return out
