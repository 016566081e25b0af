"""``EngineArgs``: the one definition of the engine's arguments and flags, and the commands
that use it (``jaxkv generate`` / ``serve`` / ``plan``, the headless launcher, ``LLM``)."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from jaxkv.engine_config import resolve_engine_config
from jaxkv.entrypoints import cli
from jaxkv.entrypoints.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parents[2]


def test_fields_are_resolve_engine_configs_arguments_with_its_defaults():
    params = inspect.signature(resolve_engine_config).parameters
    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert fields == {name: p.default for name, p in params.items()}


def _subparser(name: str):
    parser = cli.build_parser()
    return parser, parser.commands[name]


def _flags(parser) -> dict:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}


def test_generate_serve_and_plan_share_each_flags_definition():
    """Every engine flag a command has is EngineArgs': the same names, default and help (but
    --warmup's default, off for generate)."""
    _, gen = _subparser("generate")
    _, srv = _subparser("serve")
    _, plan = _subparser("plan")
    common = set(_flags(gen)) & set(_flags(srv)) & set(_flags(plan))
    assert {"--max-model-len", "--kv-cache-memory", "--block-size", "--dtype"} <= common
    for flag in common - {"-h"}:
        a, b, c = _flags(gen)[flag], _flags(srv)[flag], _flags(plan)[flag]
        assert a.option_strings == b.option_strings == c.option_strings, flag
        assert a.default == b.default == c.default, flag
        assert a.help == b.help == c.help, flag
    assert _flags(plan)["--max-model-len"].default == 2048
    assert (_flags(gen)["--warmup"].default, _flags(srv)["--warmup"].default) == ("off", "on")


def test_from_cli_args_maps_the_flags_onto_the_fields():
    parser = cli.build_parser()
    args = parser.parse_args(
        ["generate", "--kv-cache-memory", "1GiB", "--speculative-ngram", "3", "--nnodes", "2"]
    )
    ea = EngineArgs.from_cli_args(args)
    assert ea.model == "smollm2-135m-instruct" and ea.kv_cache_memory_bytes == 2**30
    assert ea.speculative_config["num_speculative_tokens"] == 3
    assert (ea.warmup, ea.max_model_len, ea.distributed_executor_backend) == (False, 2048, "mp")
    serve = EngineArgs.from_cli_args(parser.parse_args(["serve", "tiny-llama"]))
    assert (serve.model, serve.warmup, serve.distributed_executor_backend) == (
        "tiny-llama",
        True,
        "uni",
    )


def test_flag_names_name_the_library_parameters():
    names = EngineArgs.flag_names()
    assert names["kv_cache_memory_bytes"] == "--kv-cache-memory"
    assert names["cache_dtype"] == names["kv_cache_dtype"] == "--kv-cache-dtype"
    assert names["speculative_config"] == "--speculative-ngram"
    assert "model" not in names and "tokenizer" not in names


def test_add_cli_args_refuses_defaults_for_flags_it_did_not_add():
    import argparse

    with pytest.raises(ValueError, match="warmup"):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), ["seed"], defaults={"warmup": "off"})


def test_llm_keyword_arguments_are_engine_args_fields():
    from jaxkv.entrypoints.llm import LLM

    with pytest.raises(TypeError, match="kv_cache_memory"):
        LLM("tiny-llama", kv_cache_memory=1 << 20)  # the field is kv_cache_memory_bytes


def test_headless_launcher_takes_engine_args_flags(capsys):
    from jaxkv.executor import headless

    with pytest.raises(SystemExit) as e:
        headless.main(["--headless", "--nnodes", "2", "--node-rank", "2", "--master-port", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--node-rank must be in [0, --nnodes): got --node-rank=2" in err
    with pytest.raises(SystemExit):
        headless.main(["--nnodes", "2", "--node-rank", "1", "--master-port", "29500"])
    assert "--headless" in capsys.readouterr().err


def test_a_broken_command_fails_loudly():
    """A sub-command whose module does not import makes ``jaxkv`` fail with the error, not
    run without the command."""
    code = (
        "import sys\n"
        "sys.modules['jaxkv.entrypoints.cli_serve'] = None  # its import raises ImportError\n"
        "from jaxkv.entrypoints.cli import main\n"
        "sys.exit(main(['--help']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0, proc.stdout
    last = proc.stderr.strip().splitlines()[-1]  # the exception
    assert "ModuleNotFoundError" in last and "cli_serve" in last, proc.stderr
