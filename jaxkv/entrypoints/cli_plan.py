"""``jaxkv plan``: the KV-cache plan of a model's config for a memory budget (``jaxkv.plan``),
and with ``--gpu`` / ``--tpu`` the deviceless step reports. Its engine flags are
``EngineArgs``' (the same names, defaults and help as ``jaxkv generate``'s)."""

from __future__ import annotations

import dataclasses
import os
import tempfile

from jaxkv.engine_config import DEFAULT_CPU_KV_CACHE_BYTES, default_max_num_batched_tokens
from jaxkv.entrypoints.cli_common import error, name_flags
from jaxkv.entrypoints.engine_args import EngineArgs

DEFAULT_MODEL = "tiny-hybrid"

EPILOG = """\
examples:
  jaxkv plan
  jaxkv plan --model smollm2-135m-instruct --kv-cache-memory 1GiB --max-model-len 8192
  jaxkv plan --model tiny-llama --kv-cache-dtype fp8 --block-size 32
  jaxkv plan --model smollm2-135m-instruct --dtype bfloat16 --kv-cache-memory 8GiB --gpu h200
  jaxkv plan --model gemma3-270m --dtype bfloat16 --kv-cache-memory 1GiB --tpu v6e
"""

#: The engine flags the plan reads.
PLAN_FLAGS = (
    "kv_cache_memory_bytes",
    "block_size",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="print the KV-cache plan of a model config for a memory budget",
        description="Prints the KV-cache plan of a model for a memory budget: the cache groups,\n"
        "the tensors, the number of blocks and how many requests of --max-model-len\n"
        "tokens fit. Reads only the model's config (no weights, no download); without\n"
        f"--kv-cache-memory the budget is the engine's on CPU "
        f"({DEFAULT_CPU_KV_CACHE_BYTES >> 20}MiB).",
        epilog=EPILOG,
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME|PATH",
        help="tiny-llama | tiny-hybrid | smollm2-135m-instruct | HF directory | .gguf file "
        f"(default: {DEFAULT_MODEL})",
    )
    EngineArgs.add_cli_args(p, PLAN_FLAGS)
    p.add_argument(
        "--gpu",
        choices=("h200",),
        default=None,
        help="also compile a decode and a mixed step for this GPU, deviceless, and print "
        "their temp memory and each kernel's grid, shared memory and registers "
        "(needs the CUDA plugin wheels) (default: off)",
    )
    p.add_argument(
        "--tpu",
        choices=("v5e", "v6e", "v7x"),
        default=None,
        help="also compile a decode and a mixed step for this TPU generation, deviceless, "
        "and print their temp memory and each Mosaic kernel's VMEM (needs libtpu; "
        "head_dim a multiple of 128) (default: off)",
    )
    p.set_defaults(func=cmd_plan)


def plan_sizes(engine_args: EngineArgs) -> dict:
    """The plan's sizes as the engine resolves them without a device: the CPU KV budget
    when none is given, and the engine's default ``max_num_batched_tokens``."""
    ea = engine_args
    return dict(
        kv_cache_memory_bytes=ea.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES,
        max_model_len=ea.max_model_len,
        max_num_seqs=ea.max_num_seqs,
        max_num_batched_tokens=ea.max_num_batched_tokens
        or default_max_num_batched_tokens(
            ea.max_num_seqs, ea.max_model_len, ea.enable_chunked_prefill
        ),
        block_size=ea.block_size,
        kv_cache_dtype=ea.kv_cache_dtype,
    )


def cmd_plan(args) -> int:
    if args.tpu is None:
        return _plan(args, mosaic_dump_dir=None)
    # Mosaic's dumps give each kernel's SMEM (jaxkv.tpu_aot.mosaic_smem); libtpu's flags are
    # restored after, for whatever else runs in this process (the flags take effect only if
    # libtpu loads after this point)
    saved = os.environ.get("LIBTPU_INIT_ARGS")
    with tempfile.TemporaryDirectory(prefix="jaxkv-mosaic-") as dump_dir:
        try:
            return _plan(args, mosaic_dump_dir=dump_dir)
        finally:
            if saved is None:
                os.environ.pop("LIBTPU_INIT_ARGS", None)
            else:
                os.environ["LIBTPU_INIT_ARGS"] = saved


def _plan(args, *, mosaic_dump_dir: str | None) -> int:
    flags = EngineArgs.flag_names()
    if args.gpu is not None:  # before jax starts its backends (jaxkv.gpu_aot)
        from jaxkv.gpu_aot import prepare_environment

        prepare_environment()
    if args.tpu is not None:  # several libtpu processes (jaxkv.tpu_aot)
        from jaxkv.tpu_aot import prepare_environment as prepare_tpu

        prepare_tpu(mosaic_dump_dir=mosaic_dump_dir)
    from jaxkv.models.registry import gguf_layout, resolve_quantization
    from jaxkv.plan import build_plan, format_plan, layer_infos, plan_model_config

    engine_args = EngineArgs.from_cli_args(args)
    sizes = plan_sizes(engine_args)
    try:
        engine_args.check()
        config = plan_model_config(engine_args.model, dtype=engine_args.dtype)
        # an fp8 checkpoint's own fp8 weights when --quantization is not given
        quantization = resolve_quantization(engine_args.model, engine_args.quantization)
        layout = gguf_layout(engine_args.model, quantization)  # a GGUF's layers as stored
        if sizes["max_model_len"] > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={sizes['max_model_len']} exceeds the model's "
                f"max_position_embeddings={config.max_position_embeddings}"
            )
        kv_dtype = sizes["kv_cache_dtype"]
        infos = layer_infos(config)
        kw = dict(
            block_size=sizes["block_size"],
            cache_dtype=config.dtype if kv_dtype == "auto" else kv_dtype,
            kv_cache_memory_bytes=sizes["kv_cache_memory_bytes"],
            max_model_len=sizes["max_model_len"],
            max_num_batched_tokens=sizes["max_num_batched_tokens"],
        )
        plan = build_plan(infos, **kw)
        full = None
        if any(info.sliding_window is not None for info in infos.values()):  # what the windows save
            full = build_plan(
                {n: dataclasses.replace(i, sliding_window=None) for n, i in infos.items()}, **kw
            )
    except (ValueError, TypeError, OSError) as e:
        return error("plan", name_flags(e, flags))
    print(
        format_plan(
            plan,
            title=engine_args.model,
            max_model_len=sizes["max_model_len"],
            max_num_batched_tokens=sizes["max_num_batched_tokens"],
            budget=sizes["kv_cache_memory_bytes"],
            full_attention=full,
        )
    )
    reports = []  # the deviceless step reports asked for
    if args.gpu is not None:
        from jaxkv import gpu_aot

        reports.append(
            lambda: gpu_aot.gpu_step_report(
                config,
                target=args.gpu,
                quantization=quantization,
                quantized_layout=layout,
                **sizes,
            )
        )
    if args.tpu is not None:
        from jaxkv import tpu_aot

        reports.append(
            lambda: tpu_aot.tpu_step_report(
                config,
                generation=args.tpu,
                quantization=quantization,
                quantized_layout=layout,
                mosaic_dump_dir=mosaic_dump_dir,
                **sizes,
            )
        )
    for report in reports:
        try:
            print(report())
        except (ValueError, TypeError, RuntimeError) as e:
            return error("plan", name_flags(e, flags))
    return 0
