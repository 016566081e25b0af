"""The ``jaxkv`` command line: ``generate``, ``plan``, ``bench``, ``serve``, ``proxy``.

This module builds the top-level parser and runs the command asked for; each command is its
own module (``cli_generate``, ``cli_plan``, ``cli_bench``, ``cli_serve``, the P/D ``proxy``)
with an ``add_parser(sub)``. What they share is in ``cli_common`` (argument types, the help
formatter, one-line errors) and ``engine_args`` (``EngineArgs``: the engine's flags).
"""

from __future__ import annotations

import sys

from jaxkv.distributed.kv_transfer import proxy
from jaxkv.entrypoints import cli_bench, cli_generate, cli_plan, cli_serve
from jaxkv.entrypoints import cli_common as _common

# Importable from here as before (the benchmarks' scripts and tests use them).
from jaxkv.entrypoints.cli_common import Parser, parse_bytes, parse_ngram
from jaxkv.entrypoints.engine_args import ATTENTION_BACKENDS, KV_CACHE_DTYPES, MODEL_DTYPES

__all__ = [
    "ATTENTION_BACKENDS",
    "KV_CACHE_DTYPES",
    "MODEL_DTYPES",
    "build_parser",
    "main",
    "name_flags",
    "parse_bytes",
    "parse_ngram",
]

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

#: The commands, in ``jaxkv --help``'s order: modules with ``add_parser(sub)``.
COMMANDS = (cli_generate, cli_plan, cli_bench, cli_serve, proxy)


def name_flags(message) -> str:
    """``cli_common.name_flags`` with ``jaxkv generate``'s flags (the engine's and the
    sampling flags)."""
    return _common.name_flags(message, cli_generate.flag_names())


def build_parser() -> Parser:
    p = Parser(prog="jaxkv", description=DESCRIPTION, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for command in COMMANDS:
        command.add_parser(sub)
    p.commands = sub.choices  # main() reports a command's unknown flags with its own name
    return p


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
