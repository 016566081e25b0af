"""Online serving benchmark (vLLM's ``vllm bench serve``): ``jaxkv serve`` on 127.0.0.1 vs
offline ``LLM.generate`` on the same requests, in one run.

    python benchmarks/serve.py [--model tiny-llama] [--workload fixed|mixed] [--quick]
        [--num-prompts N] [--request-rate inf,8] [--max-num-seqs 64] [--kv-cache-memory 512MiB]
        [--max-model-len 1024] [--timeout 900] [--json PATH]

Requests are ``benchmarks/throughput.py``'s seeded workloads (token-id prompts, greedy, EOS
ignored), sent to ``/v1/completions`` streamed (``stream_options.include_usage``; with
``--no-stream`` one response per request, so TTFT is the latency) through ``aiohttp`` (what
``vllm bench serve`` uses; ``--client httpx`` where it is not installed), at each
``--request-rate``: "inf" sends all at t=0, a number sends a Poisson
process of that many requests a second (exponential gaps, seeded). Per rate it reports request
throughput, output tok/s, TTFT, TPOT ((latency - TTFT) / (output tokens - 1)) and ITL (gaps
between streamed chunks, one token each), mean / p50 / p99 in ms. The server is started here
(default warm-up: every program the engine can run is compiled before ``/health`` answers;
prefix caching off) and sent the requests ``--warm-passes`` times untimed before each timed
pass, with the same arrivals (warming the host side: nothing compiles after start-up; the
server's ``jaxkv:compiles_total`` is read at start, after the untimed passes and after the timed
one, and each row reports the compiles of both; and the CPU seconds the client (this process)
and the server's processes (front end, engine core: read from ``/proc``) spent in the timed
pass, since on a small machine they share the cores that run the model); then it is stopped and
``AsyncLLM`` (the server's front end and engine-core process, without HTTP) runs the same
requests. The offline baseline is an in-process ``LLM`` with the same engine flags, built and
warmed before the server starts; with ``--passes N`` each system runs N timed passes, and at
rate inf each is followed at once by an offline pass: ``vs_offline`` is the median of those
pairs' throughput ratios (drifts of a shared machine hit both halves of a pair), with their
range; a row's other figures are its median pass's.
Everything is bounded by ``--timeout``; the
server listens on 127.0.0.1 only. CPU numbers on shared cores are noisy: compare within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import resource
import signal
import socket
import subprocess
import sys
import time

import _throughput_workloads as workloads
import bench_common as bc
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # the benchmark never talks to anything else


# ---- the server ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def serve_flags(args) -> list[str]:
    flags = [
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-memory",
        str(args.kv_cache_memory),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--warmup",
        args.warmup,
        "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if args.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return flags


def engine_kwargs(args) -> dict:
    """The in-process LLM's arguments equal to :func:`serve_flags`."""
    return dict(
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        warmup=args.warmup != "off",
    )


class Server:
    """``jaxkv serve`` in a subprocess on a free 127.0.0.1 port, stopped by its pid."""

    def __init__(self, args, log_path: pathlib.Path, deadline: float, extra_flags: tuple = ()):
        import httpx

        self.url = f"http://{HOST}:{_free_port()}"
        port = self.url.rsplit(":", 1)[1]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [
            sys.executable,
            "-m",
            "jaxkv.entrypoints.cli",
            "serve",
            args.model,
            "--host",
            HOST,
            "--port",
            port,
            "--uvicorn-log-level",
            "warning",
            *serve_flags(args),
            *extra_flags,
        ]
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"jaxkv serve exited ({self.proc.returncode}): {self.log()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"jaxkv serve not healthy before the deadline: {self.log()}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                        return
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def compiles(self) -> int:
        """The server's ``jaxkv:compiles_total``: programs compiled since start (warm-up too)."""
        import httpx

        return compiles_from_metrics(httpx.get(f"{self.url}/metrics", timeout=10.0).text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def compiles_from_metrics(text: str) -> int:
    """``jaxkv:compiles_total`` of a Prometheus text page (summed over its label sets)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("jaxkv:compiles_total")
    ]
    if not values:
        raise ValueError("no jaxkv:compiles_total on the server's /metrics")
    return int(sum(values))


# ---- the client ----------------------------------------------------------------------------------


def _request_body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class _Stream:
    """What one streamed completion's SSE lines say: chunk arrival times, usage, error."""

    def __init__(self):
        self.chunks: list[float] = []
        self.usage = None
        self.error = None

    def line(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        data = json.loads(line[6:])
        if "error" in data:
            self.error = data["error"].get("message")
        elif data.get("choices"):
            self.chunks.append(time.perf_counter())
        elif data.get("usage"):
            self.usage = data["usage"]

    def result(self, sent: float, prompt: list[int]) -> dict:
        usage = self.usage
        return {
            "sent": sent,
            "end": time.perf_counter(),
            "chunks": self.chunks,
            "output_tokens": usage["completion_tokens"] if usage else len(self.chunks),
            "error": self.error,
            "prompt_tokens": usage["prompt_tokens"] if usage else len(prompt),
        }


def _whole_result(sent: float, status: int, payload) -> dict:
    """One non-streamed completion's result (its response is its only chunk)."""
    end = time.perf_counter()
    if status != 200:
        return {"error": f"{status}: {str(payload)[:300]!r}"}
    usage = payload["usage"]
    return {
        "sent": sent,
        "end": end,
        "chunks": [end],
        "output_tokens": usage["completion_tokens"],
        "error": None,
        "prompt_tokens": usage["prompt_tokens"],
    }


async def one_request(
    http, url: str, model: str, prompt: list[int], max_tokens: int, sent: float, stream: bool = True
) -> dict:
    """Streams one completion through ``http`` (an ``aiohttp.ClientSession`` or an
    ``httpx.AsyncClient``); the arrival times of its token chunks and its usage. Without
    ``stream`` the one response is its only chunk."""
    body = _request_body(model, prompt, max_tokens, stream)
    if type(http).__module__.startswith("aiohttp"):
        import aiohttp

        try:
            async with http.post(f"{url}/v1/completions", json=body) as r:
                if not stream or r.status != 200:
                    payload = await r.json() if r.status == 200 else await r.read()
                    return _whole_result(sent, r.status, payload)
                parsed = _Stream()
                async for raw in r.content:
                    parsed.line(raw.decode().rstrip("\r\n"))
        except aiohttp.ClientError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return parsed.result(sent, prompt)
    import httpx

    try:
        if not stream:
            r = await http.post(f"{url}/v1/completions", json=body)
            return _whole_result(
                sent, r.status_code, r.json() if r.status_code == 200 else r.content
            )
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return _whole_result(sent, r.status_code, await r.aread())
            parsed = _Stream()
            async for line in r.aiter_lines():
                parsed.line(line)
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return parsed.result(sent, prompt)


def client_library(name: str) -> str:
    """``--client``: "auto" is aiohttp (what ``vllm bench serve`` sends with; about a third of
    httpx's CPU per streamed token) when it is installed, else httpx."""
    if name != "auto":
        return name
    import importlib.util

    return "aiohttp" if importlib.util.find_spec("aiohttp") else "httpx"


@contextlib.asynccontextmanager
async def http_client(library: str, connections: int, timeout_s: float):
    if library == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=connections)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            yield http
        return
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        yield http


async def run_pass(
    url: str,
    model: str,
    prompts,
    outs,
    rate: float,
    seed: int,
    timeout_s: float,
    stream: bool = True,
    client: str = "httpx",
) -> dict:
    """Sends every request (Poisson at ``rate`` a second, or all at once for inf) through the
    ``client`` library ("aiohttp" | "httpx")."""
    rng = np.random.default_rng(seed)
    gaps = (
        [0.0] * len(prompts)
        if rate == float("inf")
        else rng.exponential(1.0 / rate, len(prompts)).tolist()
    )
    async with http_client(client, len(prompts), timeout_s) as http:
        t0 = time.perf_counter()
        tasks = []
        for p, n, gap in zip(prompts, outs, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(
                asyncio.create_task(
                    one_request(http, url, model, p, n, time.perf_counter(), stream)
                )
            )
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    return summarize_pass(results, t0, rate)


def summarize_pass(results: list[dict], t0: float, rate: float) -> dict:
    ok = [r for r in results if not r.get("error") and r["chunks"]]
    end = max((r["end"] for r in ok), default=t0)
    duration = end - t0
    ttft = [(r["chunks"][0] - r["sent"]) * 1e3 for r in ok]
    tpot = [
        (r["end"] - r["chunks"][0]) * 1e3 / (r["output_tokens"] - 1)
        for r in ok
        if r["output_tokens"] > 1
    ]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    out_tokens = sum(r["output_tokens"] for r in ok)
    row = {
        "request_rate": rate,
        "requests": len(results),
        "completed": len(ok),
        "errors": [r["error"] for r in results if r.get("error")][:3],
        "duration_s": duration,
        "req_per_s": len(ok) / duration if duration else None,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / duration if duration else None,
    }
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        s = bc.summarize(vals)
        row.update(
            {
                f"{name}_ms_mean": s["mean"],
                f"{name}_ms_p50": s["median"],
                f"{name}_ms_p99": s["p99"],
            }
        )
    return row


# ---- CPU accounting --------------------------------------------------------------------------------


def own_cpu_s() -> float:
    """CPU seconds (user + system) this process has used."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds used so far by ``pid`` and its children (the server and its engine-core
    process), from ``/proc``; None where there is no ``/proc``."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for p in entries:
        if not p.isdigit():
            continue
        try:  # fields after "(command)": state, ppid, ..., utime (12th), stime (13th)
            f = pathlib.Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(p) == pid or int(f[1]) == pid:
            total += (int(f[11]) + int(f[12])) / tick
    return total


# ---- offline -------------------------------------------------------------------------------------


def throughput_row(rate, requests: int, completed: int, duration: float, out_tokens: int) -> dict:
    """A pass's row of an in-process system (no HTTP: no latencies)."""
    return {
        "request_rate": rate,
        "requests": requests,
        "completed": completed,
        "duration_s": duration,
        "req_per_s": completed / duration,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / duration,
    }


def offline_engine(args, prompts, outs):
    """The in-process ``LLM`` with the server's engine flags, warmed by one untimed pass;
    returns it and a function that runs one timed pass and returns its row."""
    from jaxkv import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
    llm.generate(prompts, params, use_tqdm=False)  # untimed: warms the host side

    def timed_pass() -> dict:
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        duration = time.perf_counter() - t0
        out_tokens = sum(len(r.outputs[0].token_ids) for r in res)
        return throughput_row("offline", len(prompts), len(res), duration, out_tokens)

    return llm, timed_pass


def median_row(passes: list[dict], offline: list[dict] | None = None) -> dict:
    """One row for the timed passes of one system at one rate: the pass of median throughput
    (its latencies with it), the number of passes and, when each pass was followed by an
    offline pass, ``vs_offline``: the median of the pairs' throughput ratios (each pair ran
    back to back, so slow drifts of a shared machine cancel), with their range."""
    ranked = sorted(passes, key=lambda r: r["output_tok_per_s"])
    row = {**ranked[len(ranked) // 2], "passes": len(passes)}
    if offline:
        ratios = sorted(
            p["output_tok_per_s"] / o["output_tok_per_s"] for p, o in zip(passes, offline)
        )
        row["vs_offline"] = float(np.median(ratios))
        row["vs_offline_range"] = f"{ratios[0]:.3f}-{ratios[-1]:.3f}"
        row["vs_offline_passes"] = ratios
    return row


def run_async_llm(args, prompts, outs, offline_pass=None) -> tuple[dict, list[dict]]:
    """The server's engine without HTTP: ``AsyncLLM`` (the same front end and engine-core
    process) in this process, every request at once, streamed as deltas (one untimed pass,
    then ``--passes`` timed ones, each followed by an offline pass when ``offline_pass`` is
    given): what the process hop costs, apart from HTTP and the client. Returns its row and
    the offline passes it ran."""
    from jaxkv import SamplingParams
    from jaxkv.engine.async_llm import AsyncLLM
    from jaxkv.sampling_params import RequestOutputKind

    engine = AsyncLLM(args.model, **engine_kwargs(args))
    params = [
        SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        for n in outs
    ]

    async def one(i, tag):
        n = 0
        async for out in engine.generate(prompts[i], params[i], f"{tag}-{i}"):
            n += len(out.outputs[0].token_ids)
        return n

    async def timed(tag):
        t0, cpu0 = time.perf_counter(), own_cpu_s()
        counts = await asyncio.gather(*[one(i, tag) for i in range(len(prompts))])
        duration = time.perf_counter() - t0
        row = throughput_row("inf", len(prompts), len(prompts), duration, sum(counts))
        return {**row, "client_cpu_s": own_cpu_s() - cpu0}

    loop = asyncio.new_event_loop()
    passes, offline = [], []
    try:
        loop.run_until_complete(timed("warm"))
        for k in range(args.passes):
            passes.append(loop.run_until_complete(timed(f"timed{k}")))
            if offline_pass is not None:
                offline.append(offline_pass())
    finally:
        engine.shutdown()
        tasks = asyncio.all_tasks(loop)  # the engine's reader and watcher, cancelled by shutdown
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()
    return median_row(passes, offline), offline


# ---- main ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from jaxkv.entrypoints.cli import parse_bytes

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="tiny-llama",
        help="a model name or path jaxkv serve loads (default: tiny-llama)",
    )
    p.add_argument("--workload", default="fixed", choices=("fixed", "mixed"))
    p.add_argument(
        "--quick", action="store_true", help="throughput.py's scaled-down workload sizes"
    )
    p.add_argument(
        "--num-prompts", type=int, default=None, help="use the first N requests of the workload"
    )
    p.add_argument(
        "--request-rate", default="inf", help="comma-separated requests/s, 'inf' = all at once"
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=512 << 20)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--warmup", choices=("on", "off"), default="on")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="off by default: the untimed pass would turn the timed prompts into cache hits",
    )
    p.add_argument(
        "--warm-passes",
        type=int,
        default=2,
        help="untimed passes before each timed one (each new step shape compiles once)",
    )
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        help="timed passes per system and rate, each followed by an offline pass at rate inf "
        "(vs_offline: the median pair's ratio)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="bound on the whole run in seconds")
    p.add_argument(
        "--no-offline", action="store_true", help="skip the offline LLM.generate comparison"
    )
    p.add_argument(
        "--no-async-llm",
        action="store_true",
        help="skip the AsyncLLM row (the server's engine in this process, without HTTP)",
    )
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream each completion token by token (default), or one response per request",
    )
    p.add_argument(
        "--client",
        choices=("auto", "aiohttp", "httpx"),
        default="auto",
        help="the HTTP client library (default: aiohttp if installed, else httpx)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    deadline = time.monotonic() + args.timeout
    rates = [float(r) for r in args.request_rate.split(",")]
    if any(r <= 0 for r in rates):
        raise SystemExit(f"--request-rate must be > 0 or inf, got {args.request_rate}")
    if args.passes < 1:
        raise SystemExit(f"--passes must be at least 1, got {args.passes}")
    from jaxkv.models import load_model_config

    cfg, _ = load_model_config(args.model)
    sizes = workloads.QUICK if args.quick else workloads.FULL
    prompts, outs, desc = workloads.make_requests(args.workload, sizes, cfg.vocab_size, args.seed)
    if args.num_prompts is not None:
        prompts, outs = prompts[: args.num_prompts], outs[: args.num_prompts]
        desc["requests"] = len(prompts)
    env = bc.environment()
    client = client_library(args.client)
    env["client"] = client
    rows = []
    offline_rows: list[dict] = []  # every offline pass, each right after a pass it is paired with
    llm, offline_pass = (None, None) if args.no_offline else offline_engine(args, prompts, outs)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="jaxkv-bench-serve-") as tmp:
        t0 = time.monotonic()
        server = Server(args, pathlib.Path(tmp) / "server.log", deadline)
        startup_s = time.monotonic() - t0
        try:
            left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731

            def one_pass(rate):
                return asyncio.run(
                    run_pass(
                        server.url,
                        args.model,
                        prompts,
                        outs,
                        rate,
                        args.seed,
                        left(),
                        args.stream,
                        client,
                    )
                )

            at_start = last = server.compiles()
            for rate in rates:  # untimed passes first (same arrivals): host-side warm-up
                for _ in range(args.warm_passes):
                    one_pass(rate)
                mid = server.compiles()
                passes, paired = [], []
                for _ in range(args.passes):
                    cpu0, server0 = own_cpu_s(), tree_cpu_s(server.proc.pid)
                    row = one_pass(rate)
                    cpu1, server1 = own_cpu_s(), tree_cpu_s(server.proc.pid)
                    row["client_cpu_s"] = cpu1 - cpu0
                    row["server_cpu_s"] = (
                        None if server0 is None or server1 is None else server1 - server0
                    )
                    passes.append(row)
                    if offline_pass is not None and rate == float("inf"):
                        paired.append(offline_pass())  # back to back with this pass
                last, before = server.compiles(), last
                rows.append(
                    {
                        "system": "jaxkv serve",
                        "stream": args.stream,
                        **median_row(passes, paired),
                        "compiles_warm_passes": mid - before,
                        "compiles_timed": last - mid,
                    }
                )
                offline_rows += paired
        finally:
            server.stop()
    if not args.no_async_llm:
        row, paired = run_async_llm(args, prompts, outs, offline_pass)
        rows.append({"system": "AsyncLLM", **row})
        offline_rows += paired
    if offline_pass is not None:
        if not offline_rows:
            offline_rows.append(offline_pass())
        llm.shutdown()
        offline = median_row(offline_rows)
        for row in rows:  # other rates: against the median offline pass
            row.setdefault("vs_offline", row["output_tok_per_s"] / offline["output_tok_per_s"])
        rows.append({"system": "LLM.generate", **offline})
    payload = {
        "benchmark": "serve",
        "environment": env,
        "workload": desc,
        "model": args.model,
        "engine": engine_kwargs(args),
        "rows": rows,
        "server": {"startup_s": startup_s, "programs_at_start": at_start},
    }
    print("\n".join(bc.header_lines("jaxkv serve vs offline LLM.generate", env, desc)))
    print(
        f"# server: healthy after {startup_s:.1f} s with {at_start} programs compiled; "
        f"client: {client}"
    )
    print(
        bc.table(
            rows,
            [
                "system",
                "stream",
                "request_rate",
                "completed",
                "duration_s",
                "req_per_s",
                "output_tok_per_s",
                "passes",
                "vs_offline",
                "vs_offline_range",
                "compiles_warm_passes",
                "compiles_timed",
                "client_cpu_s",
                "server_cpu_s",
            ],
        )
    )
    print(
        bc.table(
            rows,
            [
                "system",
                "request_rate",
                "ttft_ms_mean",
                "ttft_ms_p50",
                "ttft_ms_p99",
                "tpot_ms_mean",
                "tpot_ms_p50",
                "tpot_ms_p99",
                "itl_ms_mean",
                "itl_ms_p50",
                "itl_ms_p99",
            ],
        )
    )
    if args.json:
        bc.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
