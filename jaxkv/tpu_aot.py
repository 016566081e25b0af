"""Compiling jaxkv for a TPU this machine does not have (deviceless AOT).

With the ``libtpu`` wheel jax's ``[tpu]`` extra pins (``pip install "jax[tpu]==<jax version>"``
adds only it), ``jax.experimental.topologies.get_topology_desc(platform="tpu", ...)`` gives
compile-only TPU devices of any generation on a CPU-only machine, and
``jit(...).trace(args on one).lower().compile()`` runs the real TPU compiler and Mosaic (the
Pallas TPU kernels are compiled, their VMEM checked); ``memory_analysis()`` and the optimized
HLO can be read. Nothing runs. ``jaxkv.gpu_aot`` is the same for an NVIDIA H200; both compile
the engine's own programs (``step_programs.build_program``). On a TPU the engine keeps its KV
cache in the word layout (``jaxkv.worker.kv_memory``); a runner built on this CPU gets it with
:func:`use_tpu_kv_layout` before its programs are compiled here. tests/tpu_aot uses this.

libtpu takes a lock file per process: a second process loading it (pytest-xdist workers)
needs ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (``prepare_environment``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    """One TPU generation: how libtpu names a small slice of it, and its per-core limits."""

    topology: dict  # get_topology_desc's keyword arguments
    scoped_vmem_bytes: int  # a Mosaic kernel's default VMEM budget (no vmem_limit_bytes)
    hbm_bytes: int  # HBM per chip (per core for megacore chips' whole chip)


_MEGACORE = dict(chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1))
GENERATIONS: dict[str, TpuGeneration] = {
    "v4": TpuGeneration(dict(topology_name="v4:2x2x1", **_MEGACORE), 16 << 20, 32 << 30),
    "v5e": TpuGeneration(dict(topology_name="v5e:2x2"), 16 << 20, 16 << 30),
    "v5p": TpuGeneration(dict(topology_name="v5:2x2x1", **_MEGACORE), 16 << 20, 95 << 30),
    "v6e": TpuGeneration(dict(topology_name="v6e:2x2"), 32 << 20, 32 << 30),
    "v7x": TpuGeneration(dict(topology_name="tpu7x:2x2x1"), 32 << 20, 192 << 30),
}


def prepare_environment(*, mosaic_dump_dir: str | None = None) -> None:
    """Lets several processes load libtpu (pytest-xdist); with ``mosaic_dump_dir``, has Mosaic
    write each kernel it compiles there, stage by stage (``--xla_mosaic_dump_to``; read by
    :func:`mosaic_smem`). Call before jax loads its plugins: libtpu reads its flags once."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if mosaic_dump_dir is not None:
        flags = os.environ.get("LIBTPU_INIT_ARGS", "")
        os.environ["LIBTPU_INIT_ARGS"] = f"{flags} --xla_mosaic_dump_to={mosaic_dump_dir}".strip()


def install_hint() -> str:
    import jax

    return f'pip install "jax[tpu]=={jax.__version__}" (adds the matching libtpu wheel)'


def versions() -> str:
    """``jax X, libtpu Y`` (libtpu: "absent" when not installed)."""
    import importlib.metadata as md

    import jax

    try:
        libtpu = md.version("libtpu")
    except md.PackageNotFoundError:
        libtpu = "absent"
    return f"jax {jax.__version__}, libtpu {libtpu}"


def aot_device(generation: str = "v5e", *, mesh: bool = False):
    """A compile-only device of ``generation`` ("v4" | "v5e" | "v5p" | "v6e" | "v7x"), or
    with ``mesh=True`` the slice's devices (4 chips; for a tensor-parallel compile).
    RuntimeError with the install line when libtpu is missing."""
    if generation not in GENERATIONS:
        raise ValueError(f"unknown TPU generation {generation!r}; known: {tuple(GENERATIONS)}")
    prepare_environment()
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", **GENERATIONS[generation].topology)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise RuntimeError(f"no compile-only TPU device ({e}); {install_hint()}") from e
    return list(topo.devices) if mesh else topo.devices[0]


@dataclasses.dataclass(frozen=True)
class MosaicKernel:
    """One Mosaic (Pallas TPU) kernel of a compiled program, from its optimized HLO."""

    name: str
    vmem_bytes: int  # the scoped VMEM Mosaic allocated for it (used_scoped_memory_configs)


def mosaic_kernels(compiled) -> list[MosaicKernel]:
    """The Mosaic kernels a compiled TPU program runs, each once (by name), with the VMEM the
    compiler reports for it (memory space 1 of ``used_scoped_memory_configs``)."""
    out: dict[str, MosaicKernel] = {}
    for line in compiled.as_text().splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        name = re.search(r'op_name="[^"]*?(\w+)/pallas_call"', line) or re.search(
            r"%([\w\-]+?)(?:\.\d+)? = ", line
        )
        cfg = re.search(r"backend_config=(\{.*\})", line)
        vmem = 0
        if cfg:
            try:
                used = json.loads(cfg.group(1)).get("used_scoped_memory_configs", [])
                vmem = sum(int(u["size"]) for u in used if u.get("memory_space") == "1")
            except (ValueError, KeyError):
                vmem = 0
        key = name.group(1) if name else "?"
        if key not in out or out[key].vmem_bytes < vmem:
            out[key] = MosaicKernel(key, vmem)
    return sorted(out.values(), key=lambda k: k.name)


_SMEM_MEMREF = re.compile(
    r"memref<((?:\d+x)+)(\w+), #tpu\.tiled<\(([\d,]+)\)[^>]*>, #tpu\.memory_space<smem(?:, \w+)?>>"
)


def mosaic_smem(dump_dir: str) -> dict[str, int]:
    """The SMEM each Mosaic kernel compiled since ``dump_dir`` was emptied takes for its
    operands, by kernel name: the ``memory_space<smem>`` memrefs of the kernel's signature in
    its final (LLO) stage, each padded to its tiling. Needs ``prepare_environment(
    mosaic_dump_dir=dump_dir)`` before libtpu loaded. The compiled HLO does not carry this
    (its ``used_scoped_memory_configs`` lists VMEM only)."""
    out: dict[str, int] = {}
    for name in sorted(os.listdir(dump_dir)):
        if not name.endswith("post-finalize-llo.txt"):
            continue
        with open(os.path.join(dump_dir, name)) as f:
            for line in f:
                m = re.match(r"\s*func\.func @(\w+)\((.*)", line)
                if m is None or m.group(1).startswith("transform_"):
                    continue
                total = 0
                for dims, elem, tile in _SMEM_MEMREF.findall(m.group(2)):
                    shape = [int(d) for d in dims.rstrip("x").split("x")]
                    tiles = [int(t) for t in tile.split(",")]
                    for i, t in enumerate(tiles, start=len(shape) - len(tiles)):
                        shape[i] = -(-shape[i] // t) * t
                    width = int(re.sub(r"\D", "", elem) or 32) // 8
                    total += width * math.prod(shape)
                out[m.group(1)] = max(out.get(m.group(1), 0), total)
                break
    return out


def aot_compile(jitted, device, *args, **static_kwargs):
    """trace -> lower -> compile for ``device`` (the Pallas kernels lower through Mosaic)."""
    from jaxkv import gpu_aot

    return gpu_aot.aot_compile(jitted, device, *args, **static_kwargs)


def use_tpu_kv_layout(runner) -> str:
    """Gives a runner built off a TPU (its Pallas backend in interpret mode, byte buffers) the
    KV layout it would have on a TPU (``backends.resolve_kv_layout``: the word layout when its
    sizes allow it); returns that layout. Before its first step only."""
    from jaxkv.worker.backends import resolve_kv_layout

    layout = resolve_kv_layout(
        "pallas",
        False,
        "tpu",
        head_size=runner.model_config.head_dim,
        block_size=runner.block_size,
        cache_dtype=runner.binding.cache_dtype,
    )
    if layout != runner.kv_layout:
        runner.use_kv_layout(layout)
    return layout


def compile_runner_program(runner, device, key, *, num_blocks: int | None = None):
    """The runner's program ``key`` compiled for the TPU ``device`` with the Pallas kernels
    compiled by Mosaic (not interpreted), on KV buffers of the runner's layout (see
    :func:`use_tpu_kv_layout`); ``num_blocks``: buffers of that many blocks instead of the
    runner's own (abstract: nothing that size is allocated)."""
    import jax

    from jaxkv.worker.step_programs import build_program, portable_model

    binding = dataclasses.replace(runner.binding, backend="pallas", interpret=False)
    buffers = runner.buffers
    if num_blocks is not None:
        buffers = tuple(
            jax.ShapeDtypeStruct((num_blocks * runner.page_bytes // b.dtype.itemsize,), b.dtype)
            for b in buffers
        )
    program = build_program(
        runner, key, binding=binding, buffers=buffers, model=portable_model(runner)
    )
    jitted = jax.jit(program.fn, donate_argnums=program.donate_argnums)
    return aot_compile(jitted, device, *program.abstract_args())


def compile_tp_forward(runner, devices, num_tokens: int):
    """The forward of ``num_tokens`` tokens (without the greedy head) of a one-device
    ``runner`` compiled tensor-parallel over ``devices`` (``aot_device(..., mesh=True)``), as
    the engine runs it with ``tensor_parallel_size=len(devices)``: weights split by the
    model's rules (``models.sharding``), each KV buffer split by KV heads over ``"tp"`` (a
    device's shard holds its own heads' pages, in the runner's layout), the Pallas kernels
    compiled by Mosaic under ``shard_map``. Returns the compiled executable (its HLO's
    collectives say what the devices exchange)."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxkv.models.sharding import TP_AXIS, model_rules, state_shardings
    from jaxkv.worker.forward import build_forward_fn
    from jaxkv.worker.step_programs import _packed, forward_dims, portable_model

    tp = len(devices)
    if runner.mesh is not None:
        raise ValueError("compile_tp_forward takes a one-device runner; it splits it itself")
    if runner.model_config.num_key_value_heads % tp or runner.page_bytes % tp:
        raise ValueError(
            f"{runner.model_config.num_key_value_heads} KV heads do not split over {tp} devices"
        )
    mesh = Mesh(np.array(devices), (TP_AXIS,))
    binding = dataclasses.replace(runner.binding, backend="pallas", interpret=False, mesh=mesh)
    dims = forward_dims(runner, num_tokens, greedy=False)
    graphdef, state = portable_model(runner)
    fn = build_forward_fn(graphdef, binding=binding, page_bytes=runner.page_bytes // tp, dims=dims)

    def on(x, spec):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    rules = model_rules(nnx.merge(graphdef, state))
    shardings = state_shardings(state, mesh, rules)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    buffers = tuple(on(b, PartitionSpec(TP_AXIS)) for b in runner.buffers)  # the same bytes, split
    tables = tuple(on(t, PartitionSpec()) for t in runner.tables)
    args = (
        state,
        buffers,
        tables,
        on(runner.last_sampled, PartitionSpec()),
        on(_packed(dims.empty()), PartitionSpec()),
    )
    with jax.default_device(devices[0]):  # the Pallas lowering is picked by the default device
        return jax.jit(fn, donate_argnums=(1, 2, 3)).trace(*args).lower().compile()


def tpu_step_report(
    model_config,
    *,
    generation: str = "v5e",
    kv_cache_memory_bytes: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    quantized_layout: tuple[dict, int | None] = ({}, None),
    mosaic_dump_dir: str | None = None,
) -> str:
    """What the forward of a decode step of ``max_num_seqs`` rows and of a full mixed step
    would take on a TPU ``generation``: temp memory, KV aliasing, and each Mosaic kernel's
    VMEM against the generation's scoped-VMEM budget (and its SMEM against the core's, from
    Mosaic's dumps in ``mosaic_dump_dir`` if libtpu writes them there: ``prepare_environment``);
    compiled deviceless for the model's config with abstract weights (nothing the size of the
    model is allocated)."""
    from jaxkv.pallas_kernels.mosaic_backend import SMEM_BYTES
    from jaxkv.plan import abstract_engine_for_plan
    from jaxkv.worker.program_set import FORWARD, ProgramKey

    gen = GENERATIONS.get(generation)
    if gen is None:
        raise ValueError(f"unknown TPU generation {generation!r}; known: {tuple(GENERATIONS)}")
    if model_config.head_dim % 128:
        raise ValueError(
            f"the TPU (Mosaic) attention kernel needs head_dim to be a multiple of 128, "
            f"got {model_config.head_dim}"
        )
    plan, engine, weight_bytes = abstract_engine_for_plan(
        model_config,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
        quantized_layout=quantized_layout,
    )
    cache_dtype = model_config.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    runner, dev = engine.runner, aot_device(generation)
    layout = use_tpu_kv_layout(runner)
    cache = plan.num_blocks * runner.page_bytes * len(runner.buffers)
    lines = [
        f"TPU {generation} ({dev.device_kind}, deviceless compile, {versions()}): "
        f"{model_config.num_hidden_layers} layers, hidden {model_config.hidden_size}, "
        f"{plan.num_blocks} KV blocks of {block_size} tokens ({cache / 2**30:.2f} GiB, {cache_dtype}, "
        f"KV layout {layout}); HBM {gen.hbm_bytes / 2**30:.0f} GiB"
    ]
    lines.append(
        f"  weights {weight_bytes / 2**30:.3f} GiB "
        f"({quantization + ' weight-only' if quantization else model_config.dtype})"
    )
    S = runner.buckets.seqs[-1]
    for label, T in (("decode", S), ("mixed", runner.buckets.tokens[-1])):
        if mosaic_dump_dir is not None:
            for name in os.listdir(mosaic_dump_dir):
                os.remove(os.path.join(mosaic_dump_dir, name))
        compiled = compile_runner_program(
            runner, dev, ProgramKey(FORWARD, T), num_blocks=plan.num_blocks
        )
        smem = mosaic_smem(mosaic_dump_dir) if mosaic_dump_dir is not None else {}
        ma = compiled.memory_analysis()
        lines.append(
            f"  {label} step (T={T}, S={S}): temp {ma.temp_size_in_bytes / 2**20:.1f} MiB, "
            f"arguments {ma.argument_size_in_bytes / 2**30:.2f} GiB, aliased "
            f"{ma.alias_size_in_bytes / 2**30:.2f} GiB"
        )
        for k in mosaic_kernels(compiled):
            line = f"    {k.name}: VMEM {k.vmem_bytes} B (scoped limit {gen.scoped_vmem_bytes})"
            if k.name in smem:
                line += f", SMEM {smem[k.name]} B (core {SMEM_BYTES})"
            lines.append(line)
    return "\n".join(lines)
