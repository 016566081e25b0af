"""The throughput harness runs end to end on a very small model (not a timed test).

Checks the JSON's fields, that the naive JAX baseline decodes the same greedy tokens as jaxkv
on the same weights (so jaxkv / baseline compares equal work). Each script runs once with
``--plot``: a PNG lies next to its JSON when matplotlib is installed, none otherwise (CI does
not install it). The ``jaxkv`` command line (``bench``, ``generate``) is tested in
tests/test_cli.py.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

SMALL_MODEL = (
    "num_hidden_layers=2,hidden_size=64,intermediate_size=128,vocab_size=256,"
    "num_attention_heads=4,num_key_value_heads=2,head_dim=16,max_position_embeddings=64"
)
SIZES = (
    "fixed_n=4,fixed_prompt=4:20,fixed_out=4,mixed_n=5,mixed_prompt=4:24,mixed_out=2:6,"
    "shared_n=3,shared_len=32,shared_private=3:8,shared_out=3,contexts=48,decode_batches=1:2,"
    "decode_steps=2,kv_compare_context=48"
)
ARGS = [
    "--model-config",
    SMALL_MODEL,
    "--sizes",
    SIZES,
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "32",
    "--kv-cache-memory",
    "2MiB",
    "--kv-compare",
    "1MiB,2MiB",
    "--no-compile-cache",
    "--matmul-n",
    "256",
]


@pytest.fixture(scope="module")
def throughput():
    sys.path.insert(0, str(BENCH))
    try:
        import throughput as module

        yield module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def result_path(throughput, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "throughput.json"
    throughput.main(ARGS + ["--workload", "all", "--repeats", "2", "--json", str(path), "--plot"])
    return path


@pytest.fixture(scope="module")
def result(result_path):
    return json.loads(result_path.read_text())


def assert_png(json_path: pathlib.Path, suffix: str = "") -> None:
    """``--plot`` drew ``<json stem><suffix>.png`` next to the JSON iff matplotlib is installed."""
    png = json_path.with_name(json_path.stem + suffix + ".png")
    assert png.is_file() == HAVE_MATPLOTLIB, (png, HAVE_MATPLOTLIB)


def test_throughput_plot_writes_pngs_next_to_the_json(result_path):
    assert_png(result_path)
    assert_png(result_path, "_long_decode")


def test_json_has_the_header_and_every_workload(result):
    for key in ("cpu", "cores", "jax", "jaxlib", "flax", "numpy", "python", "platform", "time"):
        assert key in result["env"], key
    assert result["matmul"]["flops_per_s"] > 0
    chain = result["model_matmuls"]  # XLA on the model's own matmul shapes
    assert chain["decode"]["lm_head"] and not chain["prefill"]["lm_head"]
    assert chain["decode"]["flops_per_s"] > 0 and chain["prefill"]["rows"] > chain["decode"]["rows"]
    assert "model FLOPs" in result["flops_formula"]
    assert set(result["results"]) == {"fixed", "mixed", "shared-prefix", "long-decode"}
    for name in ("fixed", "mixed", "shared-prefix"):
        res = result["results"][name]
        jaxkv, base = res["rows"][0], res["rows"][-1]
        assert (jaxkv["system"], base["system"]) == ("jaxkv", "naive-jax")
        for key in (
            "req_per_s",
            "output_tok_per_s",
            "total_tok_per_s",
            "ttft_ms_mean",
            "ttft_ms_median",
            "ttft_ms_p99",
            "tpot_ms_mean",
            "tpot_ms_median",
            "tpot_ms_p99",
            "peak_kv_pct",
            "preemptions",
            "compiles",
            "mfu_pct_of_matmul",
            "host",
        ):
            assert jaxkv[key] is not None, (name, key)
        assert jaxkv["compiles"] == 0, (
            "the warm pass must leave nothing to compile in the timed pass"
        )
        assert len(jaxkv["elapsed_all_s"]) == 2 and len(base["elapsed_all_s"]) == 2  # --repeats 2
        assert res["jaxkv_over_baseline"] > 0
    prefix = result["results"]["shared-prefix"]["prefix"]
    assert prefix["prefix_hit_tokens"] > 0
    assert prefix["prefill_tokens_computed_on"] < prefix["prefill_tokens_computed_off"]
    assert prefix["tokens_equal_on_off"]
    ld = result["results"]["long-decode"]
    assert [(r["context"], r["batch"]) for r in ld["rows"]] == [(48, 1), (48, 2)]
    assert all(r["jaxkv_step_ms"] and r["naive_step_ms"] for r in ld["rows"])
    assert ld["kv_size_compare"]["large_over_small"] > 0
    assert {f["figure"].split(":")[0] for f in result["headline"]} >= {
        "fixed",
        "mixed",
        "shared-prefix",
    }


def test_naive_baseline_tokens_equal_jaxkv(result):
    for name in ("fixed", "mixed", "shared-prefix"):
        equal, total = result["results"][name]["baseline_tokens_equal"].split("/")
        assert equal == total, name


def test_naive_baseline_greedy_matches_engine_on_short_prompts(throughput):
    """Direct check: same weights, left padding, row-chunked prefill, one batch and two."""
    import engine_harness as eh
    from _throughput_workloads import kv_pairs, load_model
    from naive_jax import NaiveJaxLlama

    model, tok = load_model("tiny-llama", 0, overrides=kv_pairs(SMALL_MODEL))
    prompts = [[5, 7, 9, 11, 13], [100, 3, 4], list(range(20, 45))]
    max_tokens = [6, 9, 4]
    naive = NaiveJaxLlama(model, batch_size=2, prefill_tokens=8)
    got = naive.generate(prompts, max_tokens)["tokens"]
    engine, timer = eh.build_engine(
        model, tok, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20
    )
    want = eh.run_workload(engine, timer, prompts, max_tokens, warm_pass=False)["tokens"]
    assert got == want
    assert [len(t) for t in got] == max_tokens


def test_async_ab_runs_both_modes_on_the_same_tokens(throughput, tmp_path):
    import async_ab

    path = tmp_path / "async_ab.json"
    async_ab.main(
        [
            "--model-config",
            SMALL_MODEL,
            "--requests",
            "3",
            "--prompt",
            "4:12",
            "--max-tokens",
            "3",
            "--rounds",
            "2",
            "--max-num-batched-tokens",
            "32",
            "--kv-cache-memory",
            "2MiB",
            "--json",
            str(path),
            "--plot",
        ]
    )
    result = json.loads(path.read_text())
    assert_png(path)
    assert result["summary"]["greedy_tokens_equal"] == "3/3"
    assert len(result["times_s"]["sync"]) == len(result["times_s"]["async"]) == 2
    assert result["summary"]["sync_over_async_min"] > 0 and "jax" in result["env"]


def test_spec_decode_ab_runs_both_engines_on_the_same_tokens(throughput, tmp_path):
    import spec_decode

    path = tmp_path / "spec_decode.json"
    spec_decode.main(
        [
            "--max-tokens",
            "6",
            "--rounds",
            "1",
            "--workload",
            "copy",
            "--batch",
            "all",
            "--json",
            str(path),
            "--plot",
        ]
    )
    assert_png(path)
    (row,) = json.loads(path.read_text())["rows"]
    assert (row["workload"], row["batch"], row["tokens_equal"]) == ("copy", 4, "4/4")
    assert row["plain_over_spec"] > 0 and row["drafts"] > 0  # the copy prompts get drafted


def test_ngram_proposer_benchmark_checks_and_times_both(throughput, tmp_path):
    import ngram_proposer

    path = tmp_path / "ngram.json"
    ngram_proposer.main(["--lengths", "64,300", "--vocabs", "8", "--json", str(path), "--plot"])
    rows = json.loads(path.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [64, 300] and all(r["speedup"] > 0 for r in rows)
    assert_png(path)


def test_embed_throughput_checks_both_agree(throughput, tmp_path):
    import embed_throughput

    path = tmp_path / "embed.json"
    out = embed_throughput.main(
        [
            "--model-config",
            SMALL_MODEL,
            "--requests",
            "5",
            "--min-len",
            "3",
            "--max-len",
            "40",
            "--batch",
            "4",
            "--rounds",
            "1",
            "--max-num-batched-tokens",
            "32",
            "--json",
            str(path),
            "--plot",
        ]
    )
    assert out["max_abs_diff"] < 1e-4 and out["ratio"] > 0
    assert [r["system"] for r in json.loads(path.read_text())["rows"]] == ["jaxkv", "baseline"]
    assert_png(path)


def test_attention_ab_one_small_case(throughput, tmp_path):
    """The XLA backend at HEAD against itself: one small case, one layer, one round."""
    if subprocess.run(
        ["git", "-C", str(BENCH), "rev-parse", "HEAD"], capture_output=True
    ).returncode:
        pytest.skip("attention_ab.py reads the old backend with git show: not a git checkout")
    import attention_ab

    path = tmp_path / "attention_ab.json"
    assert (
        attention_ab.main(
            [
                "--cases",
                "decode-8xU16..512",
                "--rounds",
                "1",
                "--layers",
                "1",
                "--json",
                str(path),
                "--plot",
            ]
        )
        == 0
    )
    result = json.loads(path.read_text())
    (row,) = result["rows"]
    assert row["case"] == "decode-8xU16..512" and row["old_min_ms"] > 0 and row["new_min_ms"] > 0
    assert row["diff"] < 1e-5 and result["workload"]["rev"] == "HEAD" and "cores" in result["env"]
    assert_png(path)
