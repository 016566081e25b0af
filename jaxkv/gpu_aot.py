"""Compiling jaxkv for an NVIDIA GPU this machine does not have (deviceless AOT).

XLA compiles for a GPU described by a target config (a ``stream_executor.GpuTargetConfigProto``;
``jaxkv/gpu_targets/h200.txtpb`` is XLA's H200 spec, trimmed) when the CUDA PJRT plugin is
installed: ``jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`` gives a
compile-only device, and ``jit(...).trace(args on it).lower().compile()`` a real sm_90a
executable whose ``memory_analysis()`` and optimized HLO can be read, with the Pallas Triton
kernels compiled to machine code by ptxas. Nothing runs and no GPU autotuning happens (XLA's
default GEMM configs), so GEMM temp sizes may differ from a compile on the device.

Needs ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` at the installed jaxlib's version and
``nvidia-cuda-nvcc-cu12`` (ptxas), and ``prepare_environment()`` before jax starts its
backends (the plugin's CUDA-library version check would otherwise fail on a machine without
CUDA and the plugin never registers). ``.ci/run`` installs them; tests/gpu_aot uses this.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

TARGETS_DIR = pathlib.Path(__file__).parent / "gpu_targets"
TARGETS = tuple(sorted(p.stem for p in TARGETS_DIR.glob("*.txtpb")))


def prepare_environment() -> None:
    """Lets the CUDA plugin register without CUDA libraries; call before jax starts its
    backends (the first ``jax.devices()`` or computation). Harmless on a GPU machine."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def install_hint() -> str:
    import jaxlib

    v = jaxlib.__version__
    return (
        f'pip install "jax-cuda12-plugin=={v}" "jax-cuda12-pjrt=={v}" "nvidia-cuda-nvcc-cu12>=12.8" '
        "(and set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax starts)"
    )


def target_config(target: str = "h200") -> str:
    if target not in TARGETS:
        raise ValueError(f"unknown GPU target {target!r}; known: {TARGETS}")
    return (TARGETS_DIR / f"{target}.txtpb").read_text()


def aot_device(target: str = "h200"):
    """A compile-only CUDA device for ``target``; RuntimeError with the install line when
    the CUDA plugin is missing or did not register."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=target_config(target), topology="1x1x1"
        )
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise RuntimeError(f"no compile-only CUDA device ({e}); {install_hint()}") from e
    return topo.devices[0]


def shared_memory_limit(target: str = "h200") -> int:
    """Bytes of shared memory a block may opt into on ``target`` (``shared_memory_per_block_optin``)."""
    m = re.search(r"shared_memory_per_block_optin:\s*(\d+)", target_config(target))
    return int(m.group(1))


def on_device(tree, device):
    """Every array leaf of ``tree`` (jax or numpy) as a ShapeDtypeStruct on ``device``."""
    import jax

    sharding = jax.sharding.SingleDeviceSharding(device)

    def leaf(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return x

    return jax.tree.map(leaf, tree)


def aot_compile(jitted, device, *args, **static_kwargs):
    """trace -> lower -> compile with ``device`` as the default device (jax >= 0.11's Pallas
    Triton lowering reads the GPU's compute capability from it)."""
    import jax

    with jax.default_device(device):
        return jitted.trace(*on_device(args, device), **static_kwargs).lower().compile()


def compile_runner_program(
    runner, device, key, *, num_blocks: int | None = None, report: bool = False
):
    """The runner's program ``key`` (a ``jaxkv.worker.program_set.ProgramKey``, e.g. the
    forward of a token bucket) compiled for ``device`` with the Pallas kernels lowered for the
    GPU (not interpreted): the same builder the engine's warm-up uses.

    ``num_blocks``: compile for KV buffers of that many blocks instead of the runner's own
    (a plan for a GPU's memory needs no such buffers on this machine). ``report``: also
    return the kernels' launches (``compile_with_report``)."""
    import jax
    import numpy as np

    from jaxkv.worker.step_programs import build_program, portable_model

    binding = dataclasses.replace(runner.binding, backend="pallas", interpret=False)
    buffers = runner.buffers
    if num_blocks is not None:
        buffers = tuple(
            jax.ShapeDtypeStruct((num_blocks * runner.page_bytes,), np.uint8) for _ in buffers
        )
    program = build_program(
        runner, key, binding=binding, buffers=buffers, model=portable_model(runner)
    )
    jitted = jax.jit(program.fn, donate_argnums=program.donate_argnums)
    if report:
        return compile_with_report(jitted, device, *program.abstract_args())
    return aot_compile(jitted, device, *program.abstract_args())


def gpu_step_report(
    model_config,
    *,
    target: str = "h200",
    kv_cache_memory_bytes: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    quantized_layout: tuple[dict, int | None] = ({}, None),
) -> str:
    """What the forward of a decode step of ``max_num_seqs`` rows and of a full mixed step
    would take on the GPU ``target``: each one's temp memory and KV aliasing, and each Triton
    kernel's grid,
    threads, shared memory, registers and spills, compiled deviceless for the model's config
    (weights abstract: nothing the size of the model is allocated)."""
    from jaxkv.plan import abstract_engine_for_plan
    from jaxkv.worker.program_set import FORWARD, ProgramKey

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
    runner, dev = engine.runner, aot_device(target)
    limit = shared_memory_limit(target)
    lines = [
        f"{target.upper()} (deviceless compile, no autotuning): {model_config.num_hidden_layers} "
        f"layers, hidden {model_config.hidden_size}, {plan.num_blocks} KV blocks of {block_size} "
        f"tokens ({kv_cache_memory_bytes / 2**30:.2f} GiB, {cache_dtype})"
    ]
    lines.append(
        f"  weights {weight_bytes / 2**30:.3f} GiB "
        f"({quantization + ' weight-only' if quantization else model_config.dtype})"
    )
    S = runner.buckets.seqs[-1]
    for label, T in (("decode", S), ("mixed", runner.buckets.tokens[-1])):
        compiled, kernels = compile_runner_program(
            runner, dev, ProgramKey(FORWARD, T), num_blocks=plan.num_blocks, report=True
        )
        ma = compiled.memory_analysis()
        lines.append(
            f"  {label} step (T={T}, S={S}): temp {ma.temp_size_in_bytes / 2**20:.1f} MiB, "
            f"arguments {ma.argument_size_in_bytes / 2**30:.2f} GiB, aliased "
            f"{ma.alias_size_in_bytes / 2**30:.2f} GiB"
        )
        for k in kernels:
            lines.append(
                f"    {k.name}: grid {list(k.grid)}, {k.threads[0]} threads, shared "
                f"{k.shared_mem_bytes} B (limit {limit}), {k.registers} registers, "
                f"spills {k.spill_bytes} B"
            )
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Pallas Triton kernel of a compiled program, from its optimized HLO."""

    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int | None
    shared_mem_bytes: int | None  # None: not in the backend config of this jax version


def triton_kernels(compiled) -> list[TritonKernel]:
    """The Triton kernels a compiled program launches (grid, warps, shared memory), read
    from the backend config of each ``__gpu$xla.gpu.triton`` custom call in its HLO (MLIR
    attribute syntax, ``grid_x = 8 : i32``; JSON's ``"grid_x": 8`` reads the same)."""
    out = []
    for m in re.finditer(r'custom_call_target="__gpu\$xla\.gpu\.triton"[^\n]*', compiled.as_text()):
        cfg = re.search(r"backend_config=(\{.*\})", m.group(0))
        if cfg is None:
            continue
        conf = {}
        for key, value in re.findall(r'"?(\w+)"?\s*[:=]\s*"?([\w.\-]+)"?', cfg.group(1)):
            conf.setdefault(key, value)
        out.append(
            TritonKernel(
                name=str(conf.get("name", "?")),
                grid=(
                    int(conf.get("grid_x", 1)),
                    int(conf.get("grid_y", 1)),
                    int(conf.get("grid_z", 1)),
                ),
                num_warps=int(conf.get("num_warps", 0)),
                num_stages=int(conf["num_stages"]) if "num_stages" in conf else None,
                shared_mem_bytes=int(conf["shared_mem_bytes"])
                if "shared_mem_bytes" in conf
                else None,
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """One Triton kernel as the compiled program launches it (thunk sequence) and as ptxas
    builds it for the target (``ptxas -v``)."""

    name: str
    grid: tuple[int, ...]
    threads: tuple[int, ...]
    shared_mem_bytes: int
    registers: int | None = None
    spill_bytes: int | None = None  # spill stores + loads; 0: no spill


def ptxas_path() -> str | None:
    """ptxas from the ``nvidia-cuda-nvcc-cu12`` wheel, else on PATH."""
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        p = pathlib.Path(root) / "cuda_nvcc" / "bin" / "ptxas"
        if p.exists():
            return str(p)
    return shutil.which("ptxas")


def compile_with_report(jitted, device, *args, **static_kwargs):
    """``aot_compile`` plus the program's Triton kernels: ``(compiled, [KernelLaunch])``.

    XLA dumps the compile (``xla_dump_to``, a temporary directory): the thunk sequence gives
    each kernel's grid, threads and shared memory; each kernel's PTX goes through ptxas
    (``-arch=sm_90a -v``) for its registers and spills. (jax 0.10.2's XLA dumps every kernel's
    PTX with ``xla_dump_to``; from jax 0.11 the PTX needs ``xla_dump_emitter_re`` to match
    "ptx" as well: ".*" dumps every pass's IR too, 7x the compile time, measured.)"""
    import subprocess
    import tempfile

    import jax

    with tempfile.TemporaryDirectory(prefix="jaxkv-aot-") as dump:
        with jax.default_device(device):
            lowered = jitted.trace(*on_device(args, device), **static_kwargs).lower()
            compiled = lowered.compile(
                compiler_options={"xla_dump_to": dump, "xla_dump_emitter_re": "ptx"}
            )
        names = {k.name for k in triton_kernels(compiled)}
        dump_dir = pathlib.Path(dump)
        launches: dict[str, KernelLaunch] = {}
        line_re = re.compile(
            r"\] (\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+) bytes"
        )
        for f in dump_dir.glob("*thunk_sequence*.txt"):
            for m in line_re.finditer(f.read_text()):
                if m.group(1) in names and m.group(1) not in launches:
                    launches[m.group(1)] = KernelLaunch(
                        m.group(1),
                        tuple(int(x) for x in m.group(2).split(",")),
                        tuple(int(x) for x in m.group(3).split(",")),
                        int(m.group(4)),
                    )
        ptxas = ptxas_path()
        for ptx in dump_dir.glob("*.ptx") if ptxas else ():
            text = ptx.read_text()
            found = [n for n in launches if f".entry {n}(" in text]
            if not found:
                continue
            res = subprocess.run(
                [ptxas, "-arch=sm_90a", "-v", "--warn-on-spills", str(ptx), "-o", os.devnull],
                capture_output=True,
                text=True,
                check=False,
            )
            info = res.stderr + res.stdout
            for name in found:
                regs = re.search(
                    rf"Function properties for {re.escape(name)}\n.*?Used (\d+) registers",
                    info,
                    re.S,
                )
                spills = re.search(
                    rf"Function properties for {re.escape(name)}\n\s*\d+ bytes stack frame, "
                    r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                    info,
                )
                launches[name] = dataclasses.replace(
                    launches[name],
                    registers=int(regs.group(1)) if regs else None,
                    spill_bytes=int(spills.group(1)) + int(spills.group(2)) if spills else None,
                )
    return compiled, sorted(launches.values(), key=lambda k: k.name)
