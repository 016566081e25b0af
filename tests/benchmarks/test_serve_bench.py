"""benchmarks/serve.py's statistics on hand-made timings (no server: its end-to-end run is
the numbers in benchmarks/RESULTS.md; the server itself is tested in tests/entrypoints)."""

from __future__ import annotations

import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def serve_bench():
    sys.path.insert(0, str(BENCH))
    try:
        import serve as module

        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_ttft_tpot_itl_and_throughput(serve_bench):
    # two requests sent at t0 = 0: chunks (one token each) at the listed times, then a failed one
    results = [
        {"sent": 0.0, "end": 0.7, "chunks": [0.1, 0.3, 0.7], "output_tokens": 3, "error": None},
        {"sent": 0.5, "end": 1.0, "chunks": [0.6, 1.0], "output_tokens": 2, "error": None},
        {"error": "503: b'dead'"},
    ]
    row = serve_bench.summarize_pass(results, t0=0.0, rate=float("inf"))
    assert (row["requests"], row["completed"], row["output_tokens"]) == (3, 2, 5)
    assert row["errors"] == ["503: b'dead'"]
    assert row["duration_s"] == 1.0 and row["req_per_s"] == 2.0 and row["output_tok_per_s"] == 5.0
    assert row["ttft_ms_mean"] == pytest.approx(100.0)  # 100 ms and 100 ms
    assert row["tpot_ms_mean"] == pytest.approx((300.0 + 400.0) / 2)  # (0.7-0.1)/2, (1.0-0.6)/1
    assert row["itl_ms_p50"] == pytest.approx(400.0)  # gaps 200, 400, 400
    assert row["itl_ms_mean"] == pytest.approx(1000.0 / 3)


def test_serve_flags_match_the_offline_engine(serve_bench):
    args = serve_bench.build_parser().parse_args(
        [
            "--max-num-seqs",
            "8",
            "--kv-cache-memory",
            "16MiB",
            "--max-num-batched-tokens",
            "64",
            "--warmup",
            "off",
        ]
    )
    flags = serve_bench.serve_flags(args)
    kw = serve_bench.engine_kwargs(args)
    assert flags == [
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        str(16 << 20),
        "--max-num-seqs",
        "8",
        "--warmup",
        "off",
        "--no-enable-prefix-caching",
        "--max-num-batched-tokens",
        "64",
    ]
    assert kw == dict(
        max_model_len=1024,
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        warmup=False,
    )


def test_compiles_read_from_the_metrics_page(serve_bench):
    page = (
        "# HELP jaxkv:compiles_total Programs compiled\n# TYPE jaxkv:compiles_total counter\n"
        'jaxkv:compiles_total{model_name="tiny-llama"} 33.0\n'
        'jaxkv:compiles_created{model_name="tiny-llama"} 1.7e9\n'
        'jaxkv:num_requests_running{model_name="tiny-llama"} 2.0\n'
    )
    assert serve_bench.compiles_from_metrics(page) == 33
    with pytest.raises(ValueError, match="compiles_total"):
        serve_bench.compiles_from_metrics("jaxkv:num_requests_running 1.0\n")
