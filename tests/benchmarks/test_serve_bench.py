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


def test_cpu_of_a_process_tree(serve_bench):
    """The server's CPU is its own and its live children's (the engine core): a child that
    burns 0.3 s of CPU counts in its parent's tree."""
    import os
    import subprocess
    import time

    before = serve_bench.tree_cpu_s(os.getpid())
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\ntime.sleep(30)",
        ]
    )
    try:
        deadline = time.monotonic() + 20
        while serve_bench.tree_cpu_s(child.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert serve_bench.tree_cpu_s(child.pid) >= 0.3
        assert serve_bench.tree_cpu_s(os.getpid()) - before >= 0.3
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("stream", [True, False])
def test_one_request_streamed_or_not(serve_bench, stream):
    """Streamed: one chunk per token and the usage; not streamed: the one response is the chunk."""
    import asyncio
    import json

    import httpx

    def handler(request):
        body = json.loads(request.content)
        assert body["stream"] is stream and ("stream_options" in body) is stream
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        if not stream:
            return httpx.Response(200, json={"choices": [{"text": "abc"}], "usage": usage})
        events = [{"choices": [{"text": c}]} for c in "abc"] + [{"choices": [], "usage": usage}]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await serve_bench.one_request(http, "http://test", "m", [1, 2], 3, 0.0, stream)

    r = asyncio.run(go())
    assert r["error"] is None and r["output_tokens"] == 3 and r["prompt_tokens"] == 2
    assert len(r["chunks"]) == (3 if stream else 1)


def test_median_row_pairs_each_pass_with_its_offline_pass(serve_bench):
    """vs_offline is the median of the pairs' ratios, not a ratio of medians: a slow offline
    pass next to a slow served one (a busy moment of a shared machine) cancels."""
    served = [{"output_tok_per_s": v, "ttft_ms_mean": v} for v in (90.0, 50.0, 95.0)]
    offline = [{"output_tok_per_s": v} for v in (100.0, 50.0, 100.0)]
    row = serve_bench.median_row(served, offline)
    assert row["passes"] == 3 and row["output_tok_per_s"] == 90.0 and row["ttft_ms_mean"] == 90.0
    assert row["vs_offline_passes"] == [0.9, 0.95, 1.0]
    assert row["vs_offline"] == 0.95 and row["vs_offline_range"] == "0.900-1.000"
    assert "vs_offline" not in serve_bench.median_row(served)


def test_sse_lines_give_chunks_usage_and_errors(serve_bench):
    parsed = serve_bench._Stream()
    for line in (
        'data: {"choices": [{"text": "a"}]}',
        "",
        ": keep-alive",
        'data: {"choices": [{"text": "b"}]}',
        'data: {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5}}',
        "data: [DONE]",
    ):
        parsed.line(line)
    out = parsed.result(sent=0.0, prompt=[1, 2, 3, 4, 5])
    assert len(out["chunks"]) == 2 and out["output_tokens"] == 2 and out["prompt_tokens"] == 5
    assert out["error"] is None
    failed = serve_bench._Stream()
    failed.line('data: {"error": {"message": "engine died"}}')
    assert failed.result(sent=0.0, prompt=[1])["error"] == "engine died"


def test_client_auto_prefers_aiohttp(serve_bench, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "aiohttp" else real(n, *a)
    )
    assert serve_bench.client_library("auto") == "httpx"
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert serve_bench.client_library("httpx") == "httpx"
