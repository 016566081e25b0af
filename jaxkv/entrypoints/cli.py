"""The ``jaxkv`` command line: ``plan``, ``generate``, ``bench``, ``serve``.

Shared here: the argument types (byte sizes, token ids, n-gram drafts), the help formatter, a
parser whose usage errors are one line, and ``name_flags``, which rewrites the library's
parameter names in an error message into the flags that set them.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import textwrap

DESCRIPTION = "jaxkv: a JAX/Pallas port of vLLM's paged KV-cache engine."
EPILOG = """\
examples:
  jaxkv generate
  jaxkv generate --prompt "What is a KV cache?" --max-tokens 64 --temperature 0.7 --seed 1
  jaxkv generate --model tiny-llama --prompt-token-ids 1,2,3 --max-tokens 8
  jaxkv plan --model smollm2-135m-instruct --kv-cache-memory 1GiB
  jaxkv bench --quick
  jaxkv serve smollm2-135m-instruct --port 8000

Run "jaxkv COMMAND --help" for the flags of one command.
"""

# Choices offered by the flags, kept literal so that `jaxkv --help` imports no model code
# or engine code (tests/test_cli.py checks them against models.config and the model runner).
MODEL_DTYPES = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8")
ATTENTION_BACKENDS = ("auto", "xla", "cpu", "pallas", "reference")

# "", "b"; "k", "kb" = 1000; "kib" = 1024; ... "p", "pb" = 1000**5; "pib" = 1024**5 (any case)
_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: base**i
    for i, prefix in enumerate("kmgtp", start=1)
    for suffix, base in (("", 1000), ("b", 1000), ("ib", 1024))
}


def parse_bytes(text: str) -> int:
    """'256MiB' -> 268435456; '1.5GiB', '2TB', '4e9', '1000' also work (units B, K/KB/KiB ..
    P/PB/PiB, any case; K..P are powers of 1000, Ki..Pi powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 256MiB or 2GiB)")
    try:
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (too large)")
    if int(value) <= 0:
        raise argparse.ArgumentTypeError(f"byte size must be positive: {text!r}")
    return int(value)


def parse_ngram(text: str) -> dict:
    """'K[,MAX[,MIN]]' -> the n-gram ``speculative_config`` dict: K drafts a step, n-grams
    MAX..MIN (default 4..1), e.g. '3' or '3,4,2'."""
    try:
        parts = [int(x) for x in str(text).split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3:
        raise argparse.ArgumentTypeError(f"expected K[,MAX[,MIN]] (e.g. 3 or 3,4,2), got {text!r}")
    k, hi, lo = (parts + [4, 1][len(parts) - 1 :])[:3]
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": hi,
        "prompt_lookup_min": lo,
    }


def parse_token_ids(text: str) -> list[int]:
    """'1,2,3' or '1 2 3' -> [1, 2, 3] (non-negative ints, at least one)."""
    words = [w for w in re.split(r"[\s,]+", str(text).strip()) if w]
    try:
        ids = [int(w) for w in words]
    except ValueError:
        ids = []
    if not ids or any(t < 0 for t in ids):
        raise argparse.ArgumentTypeError(
            f"expected non-negative token ids like 1,2,3, got {text!r}"
        )
    return ids


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {value}")
    return value


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help as plain text: descriptions and epilogs keep their line breaks (the examples),
    flag help wraps at spaces only (argparse's also breaks 'tiny-hybrid' at the hyphen), and
    the flag column gets 34 characters instead of 24."""

    def __init__(self, prog, **kwargs):
        kwargs.setdefault("max_help_position", 34)
        super().__init__(prog, **kwargs)

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, ``PROG: error: MESSAGE`` (the
    usage of ``generate`` alone is a screenful), exit code 2. Sub-parsers inherit the class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def error(command: str, message: str) -> int:
    """Prints ``jaxkv COMMAND: error: MESSAGE`` on stderr (one line) and returns exit code 2."""
    print(f"jaxkv {command}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


#: Engine / SamplingParams names that error messages use -> the flags that set them.
FLAG_NAMES = {
    "kv_cache_memory_bytes": "--kv-cache-memory",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_model_len": "--max-model-len",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_num_seqs": "--max-num-seqs",
    "block_size": "--block-size",
    "cache_dtype": "--kv-cache-dtype",
    "kv_cache_dtype": "--kv-cache-dtype",
    "dtype": "--dtype",
    "attention_backend": "--attention-backend",
    "tensor_parallel_size": "--tensor-parallel-size",
    "speculative_config": "--speculative-ngram",
    "async_scheduling": "--async-scheduling",
    "beam_width": "--beam-width",
    "warmup": "--warmup",
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "seed": "--seed",
    "stop": "--stop",
    "n": "-n",
    "distributed_executor_backend": "--distributed-executor-backend",
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "headless": "--headless",
    "devices_per_worker": "--devices-per-worker",
    "compile_cache": "--compile-cache",
}
_FLAG_RE = re.compile(
    r"(?<![\w-])(" + "|".join(sorted(FLAG_NAMES, key=len, reverse=True)) + r")(?![\w-])"
)


def name_flags(message: str) -> str:
    """The library's messages name its parameters; the CLI's name the flags:
    'max_tokens must be an int >= 1 (or None), got 0' -> '--max-tokens must be an int >= 1,
    got 0', and 'give the KV cache more memory' gains '(--kv-cache-memory)'."""
    text = _FLAG_RE.sub(lambda m: FLAG_NAMES[m.group(1)], str(message)).replace(" (or None)", "")
    return re.sub(r"(give the KV cache more memory)", r"\1 (--kv-cache-memory)", text, flags=re.I)


def cmd_plan(args) -> int:
    if args.gpu is not None:  # before jax starts its backends (jaxkv.gpu_aot)
        from jaxkv.gpu_aot import prepare_environment

        prepare_environment()
    from jaxkv.plan import build_plan, format_plan, layer_infos, plan_model_config

    try:
        config = plan_model_config(args.model, dtype=args.dtype)
        if args.max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={args.max_model_len} exceeds the model's "
                f"max_position_embeddings={config.max_position_embeddings}"
            )
        cache_dtype = config.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
        plan = build_plan(
            layer_infos(config),
            block_size=args.block_size,
            cache_dtype=cache_dtype,
            kv_cache_memory_bytes=args.kv_cache_memory,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    except (ValueError, TypeError, OSError) as e:
        return error("plan", name_flags(e))
    print(
        format_plan(
            plan,
            title=args.model,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            budget=args.kv_cache_memory,
        )
    )
    if args.gpu is not None:
        from jaxkv import gpu_aot

        try:
            print(
                gpu_aot.gpu_step_report(
                    config,
                    target=args.gpu,
                    kv_cache_memory_bytes=args.kv_cache_memory,
                    max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    block_size=args.block_size,
                    kv_cache_dtype=args.kv_cache_dtype,
                )
            )
        except (ValueError, TypeError, RuntimeError) as e:
            return error("plan", name_flags(e))
    return 0


PLAN_EPILOG = """\
examples:
  jaxkv plan
  jaxkv plan --model smollm2-135m-instruct --kv-cache-memory 1GiB --max-model-len 8192
  jaxkv plan --model tiny-llama --kv-cache-dtype fp8 --block-size 32
  jaxkv plan --model smollm2-135m-instruct --dtype bfloat16 --kv-cache-memory 8GiB --gpu h200
"""


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="print the KV-cache plan of a model config for a memory budget",
        description="Prints the KV-cache plan of a model for a memory budget: the cache groups,\n"
        "the tensors, the number of blocks and how many requests of --max-model-len\n"
        "tokens fit. Reads only the model's config (no weights, no download).",
        epilog=PLAN_EPILOG,
    )
    p.add_argument(
        "--model",
        default="tiny-hybrid",
        metavar="NAME|PATH",
        help="tiny-llama | tiny-hybrid | smollm2-135m-instruct | HF directory | .gguf file "
        "(default: tiny-hybrid)",
    )
    p.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        type=parse_bytes,
        default=parse_bytes("256MiB"),
        metavar="BYTES",
        help="KV cache budget, e.g. 256MiB, 2GiB, 1TiB (default: 256MiB)",
    )
    p.add_argument(
        "--block-size",
        type=power_of_two,
        default=16,
        metavar="N",
        help="tokens per KV-cache block, a power of two (default: 16)",
    )
    p.add_argument(
        "--dtype",
        choices=MODEL_DTYPES,
        default="float32",
        help="model weights dtype; the KV cache's with --kv-cache-dtype auto (default: float32)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache dtype; auto follows --dtype (default: auto)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=4096,
        metavar="N",
        help="longest request, prompt + output tokens (default: 4096)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=2048,
        metavar="N",
        help="tokens per engine step (default: 2048)",
    )
    p.add_argument(
        "--gpu",
        choices=("h200",),
        default=None,
        help="also compile a decode and a mixed step for this GPU, deviceless, and print "
        "their temp memory and each kernel's grid, shared memory and registers "
        "(needs the CUDA plugin wheels) (default: off)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=64,
        metavar="N",
        help="requests per step, for --gpu (default: 64)",
    )
    p.set_defaults(func=cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="jaxkv", description=DESCRIPTION, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    _add_generate(sub)
    _add_plan(sub)
    _add_bench(sub)
    _add_serve(sub)
    _add_proxy(sub)
    p.commands = sub.choices  # main() reports a command's unknown flags with its own name
    return p


def _add_generate(sub) -> None:
    try:
        from jaxkv.entrypoints.cli_generate import add_parser
    except ImportError:
        return
    add_parser(sub)


def _add_bench(sub) -> None:
    try:
        from jaxkv.entrypoints.cli_bench import add_parser
    except ImportError:
        return
    add_parser(sub)


def _add_serve(sub) -> None:
    try:
        from jaxkv.entrypoints.cli_serve import add_parser
    except ImportError:
        return
    add_parser(sub)


def _add_proxy(sub) -> None:
    try:
        from jaxkv.distributed.kv_transfer.proxy import add_parser
    except ImportError:
        return
    add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit code (0 done, 2 bad arguments), ``--help``
    included, so that ``jaxkv.entrypoints.cli.main([...])`` can be called in-process."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # parse_args would name "jaxkv", not the command
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:  # --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"jaxkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `jaxkv plan | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
