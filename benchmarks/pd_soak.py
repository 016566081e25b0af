"""P/D soak across three "hosts" with random link faults (root: network namespaces).

Host A runs ``jaxkv serve`` as the prefill instance, host B as the decode instance, host C
``jaxkv proxy`` and the clients: ``--concurrency`` streaming clients send completions through
the proxy for ``--duration`` seconds while A's or B's link goes down for 0.5-3 s at random
every 3-8 s, and half-way P is killed (every process on A) and started again on the same
address. At the end: every completed response's text must equal a colocated engine's
greedy text for its prompt, both instances' KV usage must be back at 0 and no process may be
left in any namespace. Failed requests (cut mid-stream) are counted, not compared.

    sudo python benchmarks/pd_soak.py --duration 180 --concurrency 64

Prints one JSON line: requests completed / failed, mismatches, faults injected, KV usage
after, processes left, the versions and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NAME = "soak"
PROMPTS = [
    f"Request {i}: the {w} of the"
    for i, w in enumerate(
        ["colour", "shape", "sound", "weight", "speed", "taste", "length", "age"] * 4
    )
]
MAX_TOKENS = 24


def client_main(url: str, concurrency: int, duration: float, out: str) -> None:
    """Runs in host C: ``concurrency`` streaming clients until ``duration`` passes."""
    import asyncio

    import httpx

    results = []

    async def one(client, i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        body = {
            "model": NAME,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text, finish = [], None
        try:
            async with client.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                if r.status_code != 200:
                    results.append({"prompt": prompt, "error": f"HTTP {r.status_code}"})
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        results.append({"prompt": prompt, "error": str(chunk["error"])[:200]})
                        return
                    for c in chunk.get("choices", []):
                        text.append(c.get("text") or "")
                        finish = c.get("finish_reason") or finish
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            results.append({"prompt": prompt, "error": type(exc).__name__})
            return
        results.append({"prompt": prompt, "text": "".join(text), "finish": finish})

    async def worker(client, k: int, stop: float) -> None:
        i = k
        while time.monotonic() < stop:
            await one(client, i)
            i += concurrency

    async def main() -> None:
        stop = time.monotonic() + duration
        limits = httpx.Limits(
            max_connections=concurrency + 8, keepalive_expiry=2.0
        )  # below the server's 5 s
        async with httpx.AsyncClient(limits=limits) as client:
            await asyncio.gather(*(worker(client, k, stop) for k in range(concurrency)))

    asyncio.run(main())
    Path(out).write_text(json.dumps(results))


def _wait_healthy(host, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    probe = f"import httpx,sys; sys.exit(0 if httpx.get('{url}/health', timeout=2).status_code == 200 else 1)"
    while host.run([sys.executable, "-c", probe], capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not come up in {timeout} s")
        time.sleep(1)


def _kv_usage(host, url: str) -> float:
    code = (
        f"import httpx; print(sum(float(l.split()[-1]) for l in httpx.get('{url}/metrics', timeout=5)"
        f".text.splitlines() if l.startswith('jaxkv:kv_cache_usage_perc')))"
    )
    r = host.run([sys.executable, "-c", code], capture_output=True, text=True)
    return float(r.stdout.strip() or "nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration", type=float, default=180.0, help="seconds of load (default: 180)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=64, help="streaming clients (default: 64)"
    )
    parser.add_argument("--seed", type=int, default=0, help="fault schedule seed (default: 0)")
    parser.add_argument(
        "--client", nargs=4, metavar=("URL", "N", "SECONDS", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.client:
        url, n, secs, out = args.client
        client_main(url, int(n), float(secs), out)
        return

    import jax

    from jaxkv import LLM, SamplingParams
    from tests.entrypoints.server_helpers import ENGINE, make_model_dir, serve_flags
    from tests.netns import Network

    tmp = Path(tempfile.mkdtemp(prefix="pd-soak-"))
    model_dir = make_model_dir(tmp / "model")
    engine = dict(ENGINE, max_num_seqs=16, kv_cache_memory_bytes=4 << 20)
    llm = LLM(str(model_dir), **engine)
    want = {
        p: o.outputs[0].text
        for p, o in zip(
            PROMPTS,
            llm.generate(
                PROMPTS,
                SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                use_tqdm=False,
            ),
        )
    }
    llm.shutdown()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    rng = random.Random(args.seed)
    faults = []
    with Network(3) as net:
        a, b, c = net.hosts

        def start(host, role, extra):
            kt = {
                "kv_connector": "JaxTransferConnector",
                "kv_role": role,
                "kv_connector_extra_config": dict(extra, host=host.address),
            }
            return host.popen(
                [
                    sys.executable,
                    "-m",
                    "jaxkv.entrypoints.cli",
                    "serve",
                    str(model_dir),
                    "--host",
                    host.address,
                    "--port",
                    "8000",
                    "--served-model-name",
                    NAME,
                    "--kv-transfer-config",
                    json.dumps(kt),
                ]
                + serve_flags(engine),
                env=env,
                cwd=ROOT,
                stdout=open(tmp / f"{role}.log", "a"),
                stderr=subprocess.STDOUT,
            )

        p_args = (a, "kv_producer", {"hold_timeout_s": 10.0})
        servers = [start(*p_args), start(b, "kv_consumer", {"load_timeout_s": 5.0})]
        p_url, d_url = f"http://{a.address}:8000", f"http://{b.address}:8000"
        _wait_healthy(c, p_url, 240)
        _wait_healthy(c, d_url, 240)
        proxy = c.popen(
            [
                sys.executable,
                "-m",
                "jaxkv.entrypoints.cli",
                "proxy",
                "--prefill",
                p_url,
                "--decode",
                d_url,
                "--host",
                c.address,
                "--port",
                "8100",
            ],
            env=env,
            cwd=ROOT,
            stdout=open(tmp / "proxy.log", "w"),
            stderr=subprocess.STDOUT,
        )
        url = f"http://{c.address}:8100"
        _wait_healthy(c, url, 60)
        out = tmp / "results.json"
        clients = c.popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--client",
                url,
                str(args.concurrency),
                str(args.duration),
                str(out),
            ],
            env=env,
            cwd=ROOT,
            stdout=open(tmp / "clients.log", "w"),
            stderr=subprocess.STDOUT,
        )
        t_end = time.monotonic() + args.duration
        restart_at = time.monotonic() + args.duration / 2
        while time.monotonic() < t_end - 5:
            if restart_at is not None and time.monotonic() > restart_at:  # P dies and comes back
                restart_at = None
                a.kill_all()
                servers[0].wait()
                servers[0] = start(*p_args)
                faults.append({"host": "P", "restart": True, "down_s": 0.0})
                continue
            time.sleep(rng.uniform(3, 8))
            host = rng.choice((a, b))
            down = rng.uniform(0.5, 3.0)
            net.cut(host)
            time.sleep(down)
            net.restore(host)
            faults.append({"host": "P" if host is a else "D", "down_s": round(down, 2)})
        clients.wait(timeout=args.duration + 180)
        time.sleep(12)  # P's hold timeout: offers no one pulled expire
        usage = {"P": _kv_usage(c, p_url), "D": _kv_usage(c, d_url)}
        stats = c.run(
            [sys.executable, "-c", f"import httpx; print(httpx.get('{url}/proxy/stats').text)"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        results = json.loads(out.read_text())
        for proc in [proxy, *servers]:
            proc.terminate()
        for proc in [proxy, *servers]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(2)
        left = {h.ns[-2:]: h.pids() for h in (a, b, c) if h.pids()}
    done = [r for r in results if "text" in r]
    wrong = [r for r in done if r["text"] != want[r["prompt"]]]
    import jaxkv

    print(
        json.dumps(
            {
                "completed": len(done),
                "failed": len(results) - len(done),
                "mismatches": len(wrong),
                "faults": len(faults),
                "link_down_s": round(sum(f["down_s"] for f in faults), 1),
                "p_restarts": sum(1 for f in faults if f.get("restart")),
                "proxy": json.loads(stats or "{}"),
                "kv_usage_after": usage,
                "processes_left_after_sigterm": left,
                "errors": sorted({r["error"] for r in results if "error" in r})[:10],
                "duration_s": args.duration,
                "concurrency": args.concurrency,
                "jaxkv": getattr(jaxkv, "__version__", "?"),
                "jax": jax.__version__,
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                "date": time.strftime("%Y-%m-%d"),
            }
        )
    )


if __name__ == "__main__":
    main()
