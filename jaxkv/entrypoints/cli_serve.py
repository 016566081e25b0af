"""``jaxkv serve MODEL``: the OpenAI-compatible server (vLLM's ``vllm serve``).

The engine core runs in its own process (``jaxkv.engine.core_client``); this process serves
HTTP with uvicorn and tokenises, detokenises and streams (``AsyncLLM``). Flags are vLLM's
where they apply; bad ones exit with code 2 and one line before anything loads.
"""

from __future__ import annotations

import argparse
import os
import sys

EPILOG = """\
examples:
  jaxkv serve smollm2-135m-instruct --port 8000 --max-model-len 2048
  jaxkv serve tiny-llama --kv-cache-memory 64MiB --api-key secret
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 8}'
"""


def add_parser(sub) -> None:
    from jaxkv.entrypoints.cli import MODEL_DTYPES, positive_int
    from jaxkv.entrypoints.engine_args import add_engine_args

    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serves a model over OpenAI's API (/v1/completions, /v1/chat/completions,\n"
        "/v1/embeddings, /v1/models) plus /health, /tokenize, /detokenize, /metrics.\n"
        "The engine core runs in its own process.",
        epilog=EPILOG,
    )
    p.add_argument(
        "model",
        nargs="?",
        default="smollm2-135m-instruct",
        metavar="MODEL",
        help="smollm2-135m-instruct | tiny-llama | tiny-hybrid | HF directory | .gguf file "
        "(default: smollm2-135m-instruct)",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name(s) requests use (default: MODEL)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("JAXKV_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $JAXKV_API_KEY, none)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level (default: info)",
    )
    g.add_argument(
        "--startup-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="longest wait for the engine core to load and warm up (default: 1800)",
    )
    g = p.add_argument_group("engine")
    g.add_argument(
        "--dtype",
        choices=MODEL_DTYPES,
        default="float32",
        help="model weights dtype (default: float32)",
    )
    add_engine_args(g)
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of shared prompt prefixes (default: on)",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        metavar="N",
        help="most logprobs a request may ask for, -1 the vocabulary (default: 20)",
    )
    g.add_argument("--seed", type=int, default=0, help="engine seed (default: 0)")
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        metavar="N",
        help="split the model over N devices (default: 1)",
    )
    p.set_defaults(func=cmd_serve)


def engine_kwargs(args) -> dict:
    from jaxkv.entrypoints.engine_args import engine_kwargs as shared

    return dict(
        shared(args),
        dtype=args.dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        max_logprobs=args.max_logprobs,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        verbose=True,
    )  # the KV budget and the warm-up's progress in the server's log


def cmd_serve(args) -> int:
    from jaxkv.entrypoints.cli import error, name_flags

    if not 0 <= args.port < 65536:
        return error("serve", f"--port must be in [0, 65536), got {args.port}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        return error(
            "serve",
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}",
        )
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < args.max_num_seqs:
        return error(
            "serve",
            f"--max-num-batched-tokens={args.max_num_batched_tokens} must be >= "
            f"--max-num-seqs={args.max_num_seqs}",
        )
    if args.tensor_parallel_size > 1:
        from jaxkv.entrypoints.cli_generate import _host_devices

        _host_devices(args.tensor_parallel_size)  # inherited by the engine-core process
    from jaxkv.engine.async_llm import AsyncLLM
    from jaxkv.entrypoints.openai.api_server import run_server

    print(f"jaxkv serve: starting the engine core for {args.model}", file=sys.stderr, flush=True)
    try:
        engine = AsyncLLM(args.model, startup_timeout_s=args.startup_timeout, **engine_kwargs(args))
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        return error("serve", name_flags(e))
    names = args.served_model_name or [args.model]
    print(
        f"jaxkv serve: {names[0]} on http://{args.host}:{args.port} "
        f"({engine.engine_core.info['num_blocks']} KV blocks, "
        f"{engine.engine_core.info.get('num_compiles', 0)} programs compiled)",
        file=sys.stderr,
        flush=True,
    )
    run_server(
        engine,
        names,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        log_level=args.uvicorn_log_level,
    )
    return 0
