"""The ``jaxkv`` command line: ``plan``, ``generate``, ``bench``."""

from __future__ import annotations

import argparse
import re
import sys

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'256MiB' -> 268435456; '1.5GiB', '4e9', '1000' also work."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 256MiB or 2GiB)")
    try:
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None
    if value <= 0:
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
    k, hi, lo = (parts + [4, 1][len(parts) - 1:])[:3]
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": hi, "prompt_lookup_min": lo}


def _layer_infos(config):
    from models.config import LayerKVInfo, layer_name

    return {
        layer_name(i): LayerKVInfo(config.num_key_value_heads, config.head_dim, config.layer_window(i))
        for i in range(config.num_hidden_layers)
    }


def cmd_plan(args) -> int:
    from models.config import get_config

    from jaxkv.plan import build_plan, format_plan

    config = get_config(args.model)
    cache_dtype = config.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    try:
        plan = build_plan(_layer_infos(config), block_size=args.block_size, cache_dtype=cache_dtype,
                          kv_cache_memory_bytes=args.kv_cache_memory, max_model_len=args.max_model_len,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    except ValueError as e:
        print(f"jaxkv plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan, title=args.model, max_model_len=args.max_model_len,
                      max_num_batched_tokens=args.max_num_batched_tokens, budget=args.kv_cache_memory))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxkv", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the KV-cache plan for a built-in model config")
    plan.add_argument("--model", default="tiny-hybrid", help="tiny-llama | tiny-hybrid")
    plan.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("256MiB"))
    plan.add_argument("--block-size", type=int, default=16)
    plan.add_argument("--kv-cache-dtype", default="auto", help="auto | float32 | bfloat16 | float16 | fp8")
    plan.add_argument("--max-model-len", type=int, default=4096)
    plan.add_argument("--max-num-batched-tokens", type=int, default=2048)
    plan.set_defaults(func=cmd_plan)

    _add_generate(sub)
    _add_bench(sub)
    return p


def _add_generate(sub) -> None:
    try:
        from jaxkv.cli_generate import add_parser
    except ImportError:
        return
    add_parser(sub)


def _add_bench(sub) -> None:
    try:
        from jaxkv.cli_bench import add_parser
    except ImportError:
        return
    add_parser(sub)


def _enable_compile_cache() -> None:
    """Persist compiled steps across CLI runs (the CLI owns its process; the library never
    touches global jax config). ``JAXKV_NO_COMPILE_CACHE=1`` turns it off."""
    import os

    if os.environ.get("JAXKV_NO_COMPILE_CACHE"):
        return
    import jax

    from models.checkpoint.smollm2 import cache_dir

    path = cache_dir() / "xla"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "plan":
        _enable_compile_cache()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
