"""``jaxkv serve`` under hostile and careless clients: each input's answer, its time, the
server's ``/health`` latency while it ran, and the front end's and engine core's memory before
and after; then a SIGTERM with a stream open (its last events, the exit code, the files left
in the server's temporary directory). Prints one table and writes one JSON.

    python benchmarks/serve_hostile.py --json serve_hostile.json

The server is the tests' 2-layer model with a byte-level tokenizer and a chat template (random
weights), ``--max-model-len 128``, started here on a free loopback port with its own TMPDIR.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import select
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.entrypoints.server_helpers import Server, make_model_dir, serve_flags

MB = 1 << 20


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class HealthProbe:
    """GET /health every 20 ms in a thread; latencies in ms (a failure counts as its time)."""

    def __init__(self, url: str):
        self.url, self.times, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                with contextlib.suppress(httpx.HTTPError):
                    http.get(f"{self.url}/health")
                self.times.append((time.perf_counter() - t0) * 1000)
                self._stop.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def raw_request(
    port: int, head: bytes, body: bytes = b"", *, chunk: int = 1 << 20, timeout: float = 120.0
) -> tuple[int | None, int, float]:
    """Sends ``head`` then ``body`` in chunks, stopping as soon as the server answers (it may
    refuse from the head alone); ``(status, response bytes, seconds to the whole answer)``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    data = b""
    t0 = time.perf_counter()

    def complete() -> bool:
        if b"\r\n\r\n" not in data:
            return False
        head_end = data.index(b"\r\n\r\n") + 4
        length = next(
            (
                int(line.split(b":")[1])
                for line in data[:head_end].split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            None,
        )
        return length is not None and len(data) >= head_end + length

    try:
        sock.sendall(head)
        for i in range(0, len(body), chunk):
            if select.select([sock], [], [], 0.02 if i == 0 else 0)[0]:
                break  # answered already (from the head, or part of the body)
            try:
                sock.sendall(body[i : i + chunk])
            except (BrokenPipeError, ConnectionResetError):
                break
        while not complete():
            try:
                got = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not got:
                break
            data += got
    finally:
        sock.close()
    seconds = time.perf_counter() - t0
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None
    return status, len(data), seconds


def post_head(
    path: str,
    length: int,
    *,
    ctype: str = "application/json",
    host: str = "127.0.0.1",
    extra: str = "",
    chunked: bool = False,
) -> bytes:
    size = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\n{size}\r\n{extra}\r\n"
    ).encode()


def json_case(port, path, obj=None, *, raw: bytes | None = None, **head_kw):
    body = raw if raw is not None else json.dumps(obj).encode()
    return lambda: raw_request(port, post_head(path, len(body), **head_kw), body)


def chunked_case(port, path, total: int):
    piece = b"x" * MB
    body = (
        b"".join(b"%x\r\n" % len(piece) + piece + b"\r\n" for _ in range(total // MB))
        + b"0\r\n\r\n"
    )
    return lambda: raw_request(port, post_head(path, 0, chunked=True), body, chunk=MB + 16)


def slowloris(port: int, pid: int, clients: int, wait_s: float) -> tuple[str, int, int]:
    """``clients`` connections sending a header byte a second; how many the server still holds
    after ``wait_s``, and its open files 1 s in and at the end."""
    socks = []
    for _ in range(clients):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        socks.append(s)
    t_end = time.monotonic() + wait_s
    fds_open = None
    while time.monotonic() < t_end:
        for s in socks:
            with contextlib.suppress(OSError):
                s.send(b"a")
        time.sleep(1.0)
        fds_open = fds_open or open_fds(pid)
    fds = open_fds(pid)
    still = 0
    for s in socks:
        s.setblocking(False)
        try:
            s.recv(1)  # b"" or the 408's first byte: the server closed it
        except BlockingIOError:
            still += 1  # nothing to read and not closed: the server holds it
        except OSError:
            pass
        s.close()
    return f"{still} of {clients} open after {wait_s:g} s", fds_open, fds


def cases(srv: Server, limits: dict) -> list[tuple[str, object]]:
    p = srv.port
    C, CHAT = "/v1/completions", "/v1/chat/completions"
    big = "a" * (7 * MB)
    return [
        ("n = 1,000,000", json_case(p, C, {"prompt": "Hi", "max_tokens": 4, "n": 1_000_000})),
        (
            "10,000 prompts in a batch",
            json_case(p, C, {"prompt": [[1, 2]] * 10_000, "max_tokens": 1}),
        ),
        (
            "50 MB prompt (Content-Length)",
            json_case(p, C, raw=b'{"prompt": "' + b"a" * (50 * MB) + b'"}'),
        ),
        ("50 MB chunked body", chunked_case(p, C, 50 * MB)),
        ("7 MB text prompt", json_case(p, C, {"prompt": big, "max_tokens": 1})),
        ("7 MB /tokenize", json_case(p, "/tokenize", {"prompt": big})),
        ("7 MB chat message", json_case(p, CHAT, {"messages": [{"role": "user", "content": big}]})),
        ("7 MB invalid JSON", json_case(p, C, raw=b"{" + b"x" * (7 * MB))),
        ("[[1.5] * 1000] * 1000 (4 MB)", json_case(p, C, {"prompt": [[1.5] * 1000] * 1000})),
        (
            "text/plain, Host + Origin evil",
            json_case(
                p,
                C,
                {"prompt": "Hi", "max_tokens": 1},
                ctype="text/plain",
                host="evil.example",
                extra="Origin: http://evil.example\r\n",
            ),
        ),
        (
            "text/plain from localhost",
            json_case(p, C, {"prompt": "Hi", "max_tokens": 1}, ctype="text/plain"),
        ),
        (
            "10^5 stop strings, n = 16",
            json_case(
                p,
                C,
                {
                    "prompt": "Hi",
                    "max_tokens": 4,
                    "n": 16,
                    "stop": [f"s{i}" for i in range(100_000)],
                },
            ),
        ),
        (
            'logit_bias {"1_000": 5}',
            json_case(p, C, {"prompt": "Hi", "max_tokens": 1, "logit_bias": {"1_000": 5}}),
        ),
        (
            "Content-Length 1000, 10 bytes sent",
            lambda: raw_request(p, post_head(C, 1000), b'{"prompt":'),
        ),
        (
            "largest allowed: 2048 prompts",
            json_case(p, C, {"prompt": [[5, 6, 7]] * 2048, "max_tokens": 1}),
        ),
        ("largest allowed: n = 128", json_case(p, C, {"prompt": "Hi", "max_tokens": 16, "n": 128})),
        (
            f"largest allowed: {limits['chars']}-char prompt",
            json_case(p, C, {"prompt": "a" * limits["chars"], "max_tokens": 1}),
        ),
    ]


def sigterm_with_open_stream(srv: Server, tmpdir: Path) -> dict:
    """SIGTERM while a stream is open: its last events, the exit code, what is left in TMPDIR."""
    events: list[str] = []

    def stream():
        body = {"prompt": "Hi", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    while len(events) < 2:
        time.sleep(0.01)
    core = srv.core_pid()
    t0 = time.perf_counter()
    os.kill(srv.pid, signal.SIGTERM)
    code = srv.proc.wait(60)
    seconds = time.perf_counter() - t0
    reader.join(10)
    return {
        "exit_code": code,
        "seconds": round(seconds, 2),
        "last_events": [e[:120] for e in events[-2:]],
        "core_alive": Path(f"/proc/{core}").exists(),
        "tmp_left": sorted(os.listdir(tmpdir)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--timeout", type=float, default=5.0, help="--timeout-header-read / --timeout-body-read"
    )
    ap.add_argument("--slowloris", type=int, default=200, help="slow clients (default: 200)")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="serve-hostile-"))
    model = make_model_dir(work / "model")
    tmpdir = work / "tmp"
    tmpdir.mkdir()
    os.environ["TMPDIR"] = str(tmpdir)  # the server's (its engine core's IPC directory)
    srv = Server(
        str(model),
        serve_flags()
        + ["--timeout-header-read", str(args.timeout), "--timeout-body-read", str(args.timeout)],
        work,
    )
    os.environ.pop("TMPDIR")
    rows = []
    try:
        core = srv.core_pid()
        httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        from jaxkv.entrypoints.openai.limits import longest_token_chars
        from jaxkv.models.tokenizer import Tokenizer

        chars = (
            longest_token_chars(Tokenizer.from_hf_dir(model)) * 128
        )  # --max-prompt-chars' default
        for name, run in cases(srv, {"chars": chars}):
            before = rss_mb(srv.pid), rss_mb(core)
            with HealthProbe(srv.url) as probe:
                status, nbytes, seconds = run()
            time.sleep(0.5)
            after = rss_mb(srv.pid), rss_mb(core)
            rows.append(
                {
                    "input": name,
                    "status": status,
                    "seconds": round(seconds, 3),
                    "response_bytes": nbytes,
                    "health_p50_ms": round(statistics.median(probe.times), 1)
                    if probe.times
                    else None,
                    "health_max_ms": round(max(probe.times), 1) if probe.times else None,
                    "front_rss_mb": [round(before[0]), round(after[0])],
                    "core_rss_mb": [round(before[1]), round(after[1])],
                }
            )
            print(rows[-1], flush=True)
        fds_idle = open_fds(srv.pid)
        t0 = time.perf_counter()
        answer, fds_during, fds_after = slowloris(
            srv.port, srv.pid, args.slowloris, args.timeout + 3
        )
        rows.append(
            {
                "input": f"{args.slowloris} slowloris clients",
                "status": answer,
                "seconds": round(time.perf_counter() - t0, 1),
                "open_fds": [fds_idle, fds_during, fds_after],
            }
        )
        print(rows[-1], flush=True)
        stop = sigterm_with_open_stream(srv, tmpdir)
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "rows": rows,
        "sigterm": stop,
        "host": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(
        "\n| input | answer | time (s) | /health p50 / max (ms) | front end RSS (MB) | core RSS (MB) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "front_rss_mb" in r:
            print(
                f"| {r['input']} | {r['status']} ({r['response_bytes']} B) | {r['seconds']} | "
                f"{r['health_p50_ms']} / {r['health_max_ms']} | {r['front_rss_mb'][0]} -> {r['front_rss_mb'][1]} | "
                f"{r['core_rss_mb'][0]} -> {r['core_rss_mb'][1]} |"
            )
        else:
            print(
                f"| {r['input']} | {r['status']} | {r['seconds']} | | open files {r['open_fds'][0]} -> "
                f"{r['open_fds'][1]} -> {r['open_fds'][2]} | |"
            )
    print(f"\nSIGTERM with a stream open: {stop}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
