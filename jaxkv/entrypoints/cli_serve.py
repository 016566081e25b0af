"""``jaxkv serve MODEL``: the OpenAI-compatible server (vLLM's ``vllm serve``).

The engine core runs in its own process (``jaxkv.engine.core_client``); this process serves
HTTP with uvicorn and tokenises, detokenises and streams (``AsyncLLM``). Flags are vLLM's
where they apply; bad ones exit with code 2 and one line before anything loads. The request
limits, host policy and connection timeouts are documented in docs/serving.md.
"""

from __future__ import annotations

import os
import sys

from jaxkv.entrypoints.cli_common import (
    error,
    host_devices,
    name_flags,
    parse_bytes,
    positive_float,
    positive_int,
)
from jaxkv.entrypoints.engine_args import SHARED_FLAGS, EngineArgs

EPILOG = """\
examples:
  jaxkv serve smollm2-135m-instruct --port 8000 --max-model-len 2048
  jaxkv serve tiny-llama --kv-cache-memory 64MiB --api-key secret
  jaxkv serve tiny-llama --host 0.0.0.0 --api-key secret --max-n 16 --max-request-body 2MiB
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 8}'
"""


def add_parser(sub) -> None:
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
    g.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names the Host and Origin headers may carry, '*' for any; others get a 403, so "
        "web pages cannot drive the server through a browser (default: localhost 127.0.0.1 "
        "::1 when --host is a loopback address, else '*')",
    )
    g.add_argument(
        "--keep-serving-on-core-death",
        action="store_true",
        help="when the engine core dies, keep answering 503 instead of exiting with code 1 "
        "(default: exit)",
    )
    g = p.add_argument_group("connections")
    g.add_argument(
        "--max-connections",
        type=positive_int,
        default=2048,
        metavar="N",
        help="open connections; one more is answered 503 and closed (default: 2048)",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=positive_float,
        default=5.0,
        metavar="S",
        help="close a keep-alive connection idle this long (default: 5)",
    )
    g.add_argument(
        "--timeout-header-read",
        type=positive_float,
        default=10.0,
        metavar="S",
        help="a request's head must arrive within S seconds of the connection or of the "
        "previous response, else 408 and close (default: 10)",
    )
    g.add_argument(
        "--timeout-body-read",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="a request's body must arrive within S seconds of its head, else 408 and close "
        "(default: 60)",
    )
    g = p.add_argument_group("request limits (each refusal is a 4xx naming the field)")
    g.add_argument(
        "--max-request-body",
        type=parse_bytes,
        default=8 << 20,
        metavar="BYTES",
        help="largest request body, else 413 (default: 8MiB)",
    )
    g.add_argument(
        "--max-n",
        type=positive_int,
        default=128,
        metavar="N",
        help="largest n and best_of (default: 128, OpenAI's)",
    )
    g.add_argument(
        "--max-sequences-per-request",
        type=positive_int,
        default=2048,
        metavar="N",
        help="most prompts x n in one request (default: 2048)",
    )
    g.add_argument(
        "--max-stop",
        type=positive_int,
        default=16,
        metavar="N",
        help="most stop strings per request (default: 16; OpenAI allows 4)",
    )
    g.add_argument(
        "--max-stop-chars",
        type=positive_int,
        default=256,
        metavar="N",
        help="longest stop string in characters (default: 256)",
    )
    g.add_argument(
        "--max-logit-bias",
        type=positive_int,
        default=1024,
        metavar="N",
        help="most logit_bias entries (default: 1024)",
    )
    g.add_argument(
        "--max-messages",
        type=positive_int,
        default=2048,
        metavar="N",
        help="most chat messages (default: 2048)",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=positive_int,
        default=None,
        metavar="N",
        help="longest text prompt (chat: its messages) in characters, refused before tokenising "
        "(default: --max-model-len x the vocabulary's longest token, which no longer prompt "
        "can fit)",
    )
    g = p.add_argument_group("engine")
    EngineArgs.add_cli_args(g, SHARED_FLAGS + ("enable_prefix_caching", "max_logprobs"))
    p.set_defaults(func=cmd_serve)


def server_options(args):
    """``(ServerLimits, HTTPOptions)`` of the flags (ValueError naming a bad one)."""
    from jaxkv.entrypoints.openai.guard import parse_allowed_hosts
    from jaxkv.entrypoints.openai.http_server import HTTPOptions
    from jaxkv.entrypoints.openai.limits import ServerLimits

    limits = ServerLimits(
        max_body_bytes=args.max_request_body,
        max_n=args.max_n,
        max_sequences=args.max_sequences_per_request,
        max_stop=args.max_stop,
        max_stop_chars=args.max_stop_chars,
        max_logit_bias=args.max_logit_bias,
        max_messages=args.max_messages,
        max_prompt_chars=args.max_prompt_chars,
    )
    http = HTTPOptions(
        allowed_hosts=parse_allowed_hosts(args.allowed_hosts, args.host),
        timeout_keep_alive_s=args.timeout_keep_alive,
        timeout_header_read_s=args.timeout_header_read,
        timeout_body_read_s=args.timeout_body_read,
        max_connections=args.max_connections,
        keep_serving_on_core_death=args.keep_serving_on_core_death,
    )
    return limits, http


def raise_open_files_limit(needed: int) -> None:
    """The soft limit on open files raised towards ``needed`` (the hard limit caps it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def cmd_serve(args) -> int:
    flags = EngineArgs.flag_names()
    if not 0 <= args.port < 65536:
        return error("serve", f"--port must be in [0, 65536), got {args.port}")
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.verbose = True  # the KV budget and the warm-up's progress in the server's log
    try:
        engine_args.check()
    except (ValueError, TypeError) as e:
        return error("serve", name_flags(e, flags))
    if args.api_key is not None and not args.api_key.strip():
        return error(
            "serve",
            f"--api-key (or $JAXKV_API_KEY) is empty ({args.api_key!r}): it would refuse "
            "every /v1 request; give a key, or none",
        )
    try:
        limits, http = server_options(args)
    except ValueError as e:
        return error("serve", str(e))
    if engine_args.tensor_parallel_size > 1:
        host_devices(engine_args.tensor_parallel_size)  # inherited by the engine-core process
    from jaxkv.engine.async_llm import AsyncLLM
    from jaxkv.entrypoints.openai.api_server import run_server

    print(f"jaxkv serve: starting the engine core for {args.model}", file=sys.stderr, flush=True)
    kwargs = engine_args.to_kwargs()
    try:
        engine = AsyncLLM(kwargs.pop("model"), startup_timeout_s=args.startup_timeout, **kwargs)
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        return error("serve", name_flags(e, flags))
    names = args.served_model_name or [args.model]
    print(
        f"jaxkv serve: {names[0]} on http://{args.host}:{args.port} "
        f"({engine.engine_core.info['num_blocks']} KV blocks, "
        f"{engine.engine_core.info.get('num_compiles', 0)} programs compiled)",
        file=sys.stderr,
        flush=True,
    )
    raise_open_files_limit(args.max_connections + 256)
    return run_server(
        engine,
        names,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        log_level=args.uvicorn_log_level,
        limits=limits,
        http=http,
    )
