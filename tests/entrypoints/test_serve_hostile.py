"""``jaxkv serve`` under hostile and careless clients, against a real key-less server on a free
loopback port (the 2-layer test model, ``--max-model-len 128``, short timeouts): every limit is
a small 4xx before any expensive work, error bodies stay small, ``/health`` keeps its latency
while large requests run, memory comes back, cross-site requests and slow clients are cut, and
the log holds no traceback for a client that left."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import statistics
import threading
import time

import httpx
import pytest

from tests.entrypoints.server_helpers import Server, make_model_dir, serve_flags

C, CHAT, EMB = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
MAX_CHARS = 100_000  # --max-prompt-chars (above the default 13 x 128, so large texts are tokenised)
TIMEOUT_S = 1.5  # --timeout-header-read and --timeout-body-read
BODY_LIMIT = 1 << 20  # --max-request-body
MAX_CONNECTIONS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(
        str(model_dir),
        serve_flags()
        + [
            "--max-request-body",
            str(BODY_LIMIT),
            "--timeout-header-read",
            str(TIMEOUT_S),
            "--timeout-body-read",
            str(TIMEOUT_S),
            "--timeout-keep-alive",
            "1",
            "--max-connections",
            str(MAX_CONNECTIONS),
            "--max-prompt-chars",
            str(MAX_CHARS),
            "--uvicorn-log-level",
            "info",
        ],
        tmp_path_factory.mktemp("serve"),
    )
    yield srv
    srv.stop()


def _post(server, path, body, **kw):
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def _raw(server, data: bytes, *, wait_s: float = 30.0) -> bytes:
    """Sends raw bytes on a fresh connection; everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as sock:
        sock.sendall(data)
        out = b""
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            while chunk := sock.recv(65536):
                out += chunk
    return out


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


# ---- limits: refused from the request's shape, before tokenising or queuing ----------------------


def test_default_prompt_chars_bound_no_prompt_that_fits(model_dir):
    """--max-prompt-chars' default is max_model_len x the longest token in characters: every
    text has at least len(text) / longest tokens, so a longer text cannot fit."""
    from jaxkv.entrypoints.openai.limits import ServerLimits, longest_token_chars
    from jaxkv.models.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(model_dir)
    longest = longest_token_chars(tok)
    assert longest == 13 and ServerLimits().resolved(tok, 128).max_prompt_chars == 13 * 128
    vocab = sorted(tok.backend.get_vocab(with_added_tokens=True), key=len)
    for text in [
        "a" * 5000,
        " " * 5000,
        "".join(vocab[-40:]) * 20,
        "hello the world " * 300,
        "\u00e9\u4e16" * 900,
    ]:
        assert len(tok.encode(text)) >= len(text) / longest


LIMITS = [  # (path, body, the field named, the flag or bound the message names)
    (C, {"prompt": "Hi", "max_tokens": 4, "n": 1_000_000}, "n", "--max-n"),
    (C, {"prompt": "Hi", "max_tokens": 4, "n": 129}, "n", "--max-n"),
    (C, {"prompt": "Hi", "max_tokens": 4, "n": 1, "best_of": 10**6}, "best_of", "--max-n"),
    (C, {"prompt": [[1, 2]] * 10_000, "max_tokens": 1}, "prompt", "--max-sequences-per-request"),
    (
        C,
        {"prompt": [[1, 2]] * 17, "max_tokens": 1, "n": 128},
        "n",
        "--max-sequences-per-request",
    ),  # 2,176
    (C, {"prompt": "Hi", "stop": [f"s{i}" for i in range(17)]}, "stop", "--max-stop"),
    (C, {"prompt": "Hi", "stop": "x" * 257}, "stop", "--max-stop-chars"),
    (
        C,
        {"prompt": "Hi", "logit_bias": {str(i): 1.0 for i in range(1025)}},
        "logit_bias",
        "--max-logit-bias",
    ),
    (C, {"prompt": "a" * (MAX_CHARS + 1)}, "prompt", "--max-prompt-chars"),
    (C, {"prompt": ["Hi", "a" * (MAX_CHARS + 1)]}, "prompt", "--max-prompt-chars"),
    (C, {"prompt": [5] * 129}, "prompt", "max_model_len"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}] * 2049}, "messages", "--max-messages"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "a" * (MAX_CHARS + 1)}]},
        "messages",
        "--max-prompt-chars",
    ),
    (
        CHAT,
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a" * (MAX_CHARS + 1)}]}
            ]
        },
        "messages",
        "--max-prompt-chars",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "n": 1000}, "n", "--max-n"),
    (EMB, {"input": ["Hi"] * 2049}, "input", "--max-sequences-per-request"),
    (EMB, {"input": "a" * (MAX_CHARS + 1)}, "input", "--max-prompt-chars"),
    ("/tokenize", {"prompt": "a" * (MAX_CHARS + 1)}, "prompt", "--max-prompt-chars"),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "a" * (MAX_CHARS + 1)}]},
        "messages",
        "--max-prompt-chars",
    ),
    ("/detokenize", {"tokens": [5] * 129}, "tokens", "max_model_len"),
]


@pytest.mark.parametrize(
    "path,body,named,bound",
    LIMITS,
    ids=[f"{p.rsplit('/', 1)[-1]}-{n}-{i}" for i, (p, _, n, _) in enumerate(LIMITS)],
)
def test_limit_is_a_small_400_naming_the_field(server, path, body, named, bound):
    t0 = time.perf_counter()
    r = _post(server, path, body)
    assert r.status_code == 400, r.text[:500]
    assert time.perf_counter() - t0 < 5
    error = r.json()["error"]
    assert error["param"] == named and bound in error["message"], error
    assert len(r.content) < 1000  # the input is never copied back


def test_largest_allowed_requests_run(server):
    r = _post(
        server,
        C,
        {
            "prompt": "Hi",
            "max_tokens": 2,
            "n": 128,
            "stop": ["x" * 256] * 16,
            "logit_bias": {str(i): 0.0 for i in range(200)},
        },
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 128
    r = _post(server, C, {"prompt": [[5, 6]] * 2048, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2048
    # a prompt at the character cap is tokenised (in a worker) and refused by its token count
    r = _post(server, "/tokenize", {"prompt": "ab " * (MAX_CHARS // 3)})
    assert r.status_code == 200 and r.json()["count"] > 128
    r = _post(server, C, {"prompt": "ab " * (MAX_CHARS // 3)})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "key", ["1_0", "1_000", " 5", "+5", "05", "\u0665", "5 ", "0x5", "5.0", "9" * 30]
)
def test_logit_bias_keys_must_be_decimal_integers(server, key):
    r = _post(server, C, {"prompt": "Hi", "max_tokens": 1, "logit_bias": {key: 1.0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_logit_bias_canonical_key_works(server):
    assert (
        _post(
            server, C, {"prompt": "Hi", "max_tokens": 1, "logit_bias": {"5": 1.0, "0": -1.0}}
        ).status_code
        == 200
    )


# ---- the body: 413 before reading, small error bodies ------------------------------------------------


def test_body_over_the_limit_is_a_413_from_its_head(server):
    head = (
        f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {50 << 20}\r\n\r\n"
    ).encode()
    t0 = time.perf_counter()
    out = _raw(server, head)  # no body sent: the head alone is refused
    assert _status(out) == 413 and time.perf_counter() - t0 < 2
    assert b"--max-request-body" in out and b"connection: close" in out.lower()


def test_chunked_body_over_the_limit_is_cut(server):
    piece = b"x" * 65536

    def chunks():
        for _ in range(3 * BODY_LIMIT // len(piece)):
            yield piece

    with contextlib.suppress(httpx.HTTPError):  # the server may close while the client still sends
        r = httpx.post(
            f"{server.url}{C}",
            content=chunks(),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 413, r.text


@pytest.mark.parametrize(
    "body",
    [
        b"{" + b"x" * 900_000,
        json.dumps({"prompt": [[1.5] * 300] * 300}).encode(),
        json.dumps({"prompt": "Hi", "stop": [1] * 100_000}).encode(),
        json.dumps({"prompt": "Hi", "user": ["u" * 1000] * 100}).encode(),
    ],
    ids=["invalid-json", "float-grid", "int-stops", "long-user"],
)
def test_validation_errors_quote_a_bounded_excerpt(server, body):
    r = httpx.post(
        f"{server.url}{C}", content=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert r.status_code == 400 and len(r.content) < 1000, len(r.content)


# ---- cross-site: JSON only, Host and Origin ----------------------------------------------------------

BODY = json.dumps({"prompt": "Hi", "max_tokens": 1})


@pytest.mark.parametrize(
    "headers,status",
    [
        ({"Content-Type": "text/plain"}, 415),
        ({}, 415),  # no Content-Type (a fetch of a Blob)
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Content-Type": "application/json", "Host": "evil.example"}, 403),
        (
            {"Content-Type": "text/plain", "Host": "evil.example", "Origin": "http://evil.example"},
            403,
        ),
        ({"Content-Type": "application/json", "Origin": "http://evil.example"}, 403),
        ({"Content-Type": "application/json", "Origin": "null"}, 403),
        ({"Content-Type": "application/json", "Host": "localhost.evil.example"}, 403),
        ({"Content-Type": "application/json; charset=utf-8", "Host": "localhost"}, 200),
        ({"Content-Type": "application/json", "Origin": "http://localhost:3000"}, 200),
        ({"Content-Type": "application/json", "Host": "[::1]"}, 200),
    ],
)
def test_json_only_and_loopback_hosts(server, headers, status):
    r = httpx.post(f"{server.url}{C}", content=BODY, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]["code"] == status


def test_get_routes_check_the_host_too(server):
    assert (
        httpx.get(
            f"{server.url}/v1/models", headers={"Host": "rebound.example"}, timeout=10
        ).status_code
        == 403
    )
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 200


# ---- the event loop stays free; memory comes back ------------------------------------------------------


def _health_latencies(server, stop: threading.Event, out: list[float]):
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            http.get(f"{server.url}/health")
            out.append(time.perf_counter() - t0)
            stop.wait(0.02)


def test_health_stays_fast_during_large_requests(server):
    """Large requests (2,048 prompts, 8 texts of 100,000 characters tokenised in a worker,
    900 kB texts refused from their length) run while /health is probed: its median stays a
    few ms, its worst well under a second."""
    latencies: list[float] = []
    stop = threading.Event()
    probe = threading.Thread(target=_health_latencies, args=(server, stop, latencies))
    probe.start()
    try:
        bodies = (
            [(C, {"prompt": [[5, 6, 7]] * 2048, "max_tokens": 1})]
            + [("/tokenize", {"prompt": "ab " * (MAX_CHARS // 3)})] * 8
            + [
                (C, {"prompt": "a" * 900_000}),
                (CHAT, {"messages": [{"role": "user", "content": "a" * 900_000}]}),
            ]
        )
        for path, body in bodies:
            assert _post(server, path, body).status_code in (200, 400)
    finally:
        stop.set()
        probe.join()
    assert len(latencies) >= 5
    assert statistics.median(latencies) < 0.05 and max(latencies) < 1.0, sorted(latencies)[-5:]


def test_front_end_memory_returns_after_large_requests(server):
    before = server.rss_mb()
    for _ in range(5):
        _post(server, C, {"prompt": "a" * 1_000_000})
        _post(server, "/tokenize", {"messages": [{"role": "user", "content": "b" * 1_000_000}]})
        httpx.post(
            f"{server.url}{C}",
            content=json.dumps({"prompt": [[1.5] * 200] * 500}),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
    time.sleep(0.5)
    assert server.rss_mb() - before < 64, (before, server.rss_mb())


# ---- slow and idle clients ----------------------------------------------------------------------------


def test_slow_header_clients_are_cut(server):
    """Clients sending a header byte every 0.3 s (each byte would restart uvicorn's keep-alive
    timer) are closed once --timeout-header-read passes, with a 408."""
    idle_files = server.open_files()
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(40)]
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    deadline = time.monotonic() + TIMEOUT_S + 2.0
    while time.monotonic() < deadline:
        for s in socks:
            with contextlib.suppress(OSError):
                s.send(b"a")
        time.sleep(0.3)
    answers = []
    for s in socks:
        s.settimeout(2)
        with contextlib.suppress(OSError):
            answers.append(s.recv(65536))
        s.close()
    assert len(answers) == 40 and all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[:3]
    assert server.open_files() <= idle_files + 2


def test_body_shorter_than_its_length_is_a_408(server):
    head = (
        f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n"
    ).encode()
    t0 = time.perf_counter()
    out = _raw(server, head + b'{"prompt":')
    assert _status(out) == 408 and TIMEOUT_S - 0.1 < time.perf_counter() - t0 < TIMEOUT_S + 3
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_idle_keep_alive_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        t0 = time.perf_counter()
        assert sock.recv(65536) == b""  # closed by the server, without a word
        assert time.perf_counter() - t0 < 3


def test_connections_over_the_cap_get_a_503(server):
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):
            socks.append(socket.create_connection(("127.0.0.1", server.port)))
        time.sleep(0.3)
        refused = 0
        for s in socks:
            if select.select([s], [], [], 0)[0]:
                data = s.recv(65536)
                refused += data.startswith(b"HTTP/1.1 503")
        assert refused >= 8
    finally:
        for s in socks:
            s.close()
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# ---- the log ------------------------------------------------------------------------------------------------


def test_client_leaving_mid_upload_leaves_no_traceback(server):
    head = (
        f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Content-Length: 100000\r\n\r\n"
    ).encode()
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head + b'{"prompt": "' + b"a" * 5000)
            time.sleep(0.1)
    time.sleep(0.5)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    log = server.log(200_000)
    assert "left while sending" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
