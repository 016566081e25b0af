"""``jaxkv bench``: runs ``benchmarks/throughput.py`` with the same arguments;
``jaxkv bench peers ...`` runs ``benchmarks/peers.py`` (jaxkv vs vLLM's CPU build and llama.cpp).

``benchmarks/`` is not an installed package (it sits next to the packages in the repository,
like vLLM's), so this command finds it from the checkout: ``$JAXKV_BENCHMARKS_DIR`` if set,
else ``<repo>/benchmarks`` next to this installed ``jaxkv`` package (editable installs and
``pip install -e .`` checkouts). The folder goes on ``sys.path`` because the benchmark scripts
import their siblings (``bench_common``, ``naive_jax``) by file name, as they do when run as
``python benchmarks/throughput.py``. From a wheel without the repository the command says so.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import sys

from jaxkv.entrypoints.cli_common import error


def benchmarks_dir() -> pathlib.Path:
    env = os.environ.get("JAXKV_BENCHMARKS_DIR")
    return pathlib.Path(env) if env else pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str = "throughput"):
    """A benchmark module (``throughput``, ``peers``), imported from the checkout's benchmarks folder."""
    d = benchmarks_dir()
    if not (d / f"{name}.py").is_file():
        raise FileNotFoundError(
            f"no benchmarks/{name}.py at {d}: jaxkv bench runs from a source "
            f"checkout (or set JAXKV_BENCHMARKS_DIR)"
        )
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))
    return importlib.import_module(name)


def cmd_bench(args) -> int:
    argv = list(args.bench_args)
    name = "throughput"
    if argv and argv[0] == "peers":
        name, argv = "peers", argv[1:]
    try:
        module = load_benchmark(name)
    except FileNotFoundError as e:
        return error("bench", e)
    try:
        module.main(argv)
    except SystemExit as e:  # its argparse: --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    return 0


def add_parser(sub) -> None:
    # Every argument after `bench` is forwarded untouched. prefix_chars="+" makes this
    # sub-parser treat "--quick" etc. as plain words for the REMAINDER positional (with "-" it
    # would match REMAINDER against nothing and reject the options, an argparse quirk).
    p = sub.add_parser(
        "bench",
        help="offline throughput benchmark (benchmarks/throughput.py)",
        add_help=False,
        prefix_chars="+",
        description="Runs benchmarks/throughput.py with the arguments given; "
        "jaxkv bench --help lists them. `jaxkv bench peers ARGS` runs "
        "benchmarks/peers.py instead (jaxkv bench peers --help).",
    )
    p.add_argument(
        "bench_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="arguments for benchmarks/throughput.py (default: none)",
    )
    p.set_defaults(func=cmd_bench)
