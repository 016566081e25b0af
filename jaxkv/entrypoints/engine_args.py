"""The engine flags ``jaxkv generate`` and ``jaxkv serve`` share (vLLM's ``EngineArgs``
CLI arguments), defined once: same names, defaults and help on both commands."""

from __future__ import annotations


def add_engine_args(g, *, warmup: str = "on") -> None:
    """Adds the engine's flags to the argparse group ``g``. What they become: ``engine_kwargs``.

    ``warmup``: the ``--warmup`` default. ``jaxkv serve`` warms up (requests it cannot foresee
    must never wait for a compile); ``jaxkv generate`` runs one known batch and exits, so it
    compiles only what that batch runs, on first use (4 prompts: 8 programs, not the whole
    set's 55; the persistent cache makes a second run compile nothing either way)."""
    from jaxkv.entrypoints.cli import (
        ATTENTION_BACKENDS,
        KV_CACHE_DTYPES,
        parse_bytes,
        parse_ngram,
        positive_int,
        power_of_two,
    )

    g.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="KV cache budget, e.g. 256MiB or 2GiB (default: 512MiB on CPU, "
        "--gpu-memory-utilization of the device's memory on GPU)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="share of GPU memory the engine may use when --kv-cache-memory is not given "
        "(default: 0.9)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache dtype; auto follows --dtype (default: auto)",
    )
    g.add_argument(
        "--block-size",
        type=power_of_two,
        default=16,
        metavar="N",
        help="tokens per KV-cache block, a power of two (default: 16)",
    )
    g.add_argument(
        "--max-model-len",
        type=positive_int,
        default=2048,
        metavar="N",
        help="longest request, prompt + output tokens (default: 2048)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=64,
        metavar="N",
        help="most requests per step (default: 64)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="most tokens per step (default: 2048, or --max-num-seqs when larger)",
    )
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="attention implementation (default: auto)",
    )
    g.add_argument(
        "--warmup",
        choices=("on", "off"),
        default=warmup,
        help="compile every program the engine can run at load, so nothing compiles "
        f"while it works; off compiles each on first use (default: {warmup})",
    )
    g.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR|off",
        help="jax's persistent compilation cache, so a restart reads its programs back "
        "(default: $JAXKV_COMPILE_CACHE, else ~/.cache/jaxkv/xla; off: not used)",
    )
    g.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule step N+1 while step N runs: same tokens, pays on GPU / TPU (default: off)",
    )
    g.add_argument(
        "--speculative-ngram",
        type=parse_ngram,
        default=None,
        metavar="K[,MAX[,MIN]]",
        help="draft K tokens a step by n-gram lookup over each request's tokens, n-grams "
        "MAX..MIN long (default: off; MAX..MIN 4..1)",
    )
    g.add_argument(
        "--kv-transfer-config",
        type=parse_kv_transfer_config,
        default=None,
        metavar="JSON",
        help='the KV connector, as vLLM\'s flag: e.g. \'{"kv_connector": "JaxTransferConnector", '
        '"kv_role": "kv_producer"}\' for a prefill instance (default: none)',
    )


def parse_kv_transfer_config(text: str):
    """``--kv-transfer-config`` JSON -> ``KVTransferConfig`` (argparse reports a bad one)."""
    import argparse  # noqa: PLC0415

    from jaxkv.distributed.kv_transfer.config import KVTransferConfig  # noqa: PLC0415

    try:
        return KVTransferConfig.from_any(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_kwargs(args) -> dict:
    """The ``LLM(...)`` / ``AsyncLLM`` arguments of the flags ``add_engine_args`` adds."""
    return dict(
        kv_cache_memory_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        warmup=args.warmup != "off",
        compile_cache=True if args.compile_cache is None else args.compile_cache,
        async_scheduling=args.async_scheduling,
        speculative_config=args.speculative_ngram,
        kv_transfer_config=args.kv_transfer_config,
    )
