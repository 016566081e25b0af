"""P/D through HTTP: ``jaxkv serve`` as a prefill and as a decode instance (JaxTransferConnector)
behind ``jaxkv proxy``. The streamed text through the proxy equals an in-process engine's (a
colocated engine of the same model and settings), the KV went through P (the proxy saw no
prefill failure, P answered with kv_transfer_params), and P's blocks are all free again."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.entrypoints.server_helpers import (
    ENGINE,
    ROOT,
    Server,
    free_port,
    make_model_dir,
    serve_flags,
)

pytestmark = pytest.mark.slow  # engines and servers in several processes

NAME = "pd-model"
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived",
    "1 2 3 4 5 6 7 8 9",
]


def transfer_flags(role: str) -> list[str]:
    return [
        "--kv-transfer-config",
        json.dumps({"kv_connector": "JaxTransferConnector", "kv_role": role}),
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def pd(model_dir, tmp_path_factory):
    """(prefill server, decode server, proxy URL)."""
    flags = serve_flags() + ["--served-model-name", NAME]
    started = []
    proxy = None
    try:
        p = Server(
            str(model_dir), flags + transfer_flags("kv_producer"), tmp_path_factory.mktemp("p")
        )
        started.append(p)
        d = Server(
            str(model_dir), flags + transfer_flags("kv_consumer"), tmp_path_factory.mktemp("d")
        )
        started.append(d)
        port = free_port()
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxkv.entrypoints.cli",
                "proxy",
                "--prefill",
                p.url,
                "--decode",
                d.url,
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proxy.poll() is None, "proxy did not come up"
            time.sleep(0.3)
        yield p, d, url
    finally:
        if proxy is not None:
            proxy.kill()
            proxy.wait(10)
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def llm(model_dir):
    from jaxkv import LLM

    engine = LLM(str(model_dir), **ENGINE)
    yield engine
    engine.shutdown()


def stream_text(url: str, path: str, body: dict) -> tuple[str, list[str]]:
    texts, finish = [], []
    with httpx.stream("POST", url + path, json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                texts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
                if c.get("finish_reason"):
                    finish.append(c["finish_reason"])
    return "".join(texts), finish


def test_proxy_stream_equals_colocated(pd, llm):
    from jaxkv import SamplingParams

    p, d, url = pd
    for prompt in PROMPTS:
        want = (
            llm.generate(
                [prompt],
                SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                use_tqdm=False,
            )[0]
            .outputs[0]
            .text
        )
        text, finish = stream_text(
            url,
            "/v1/completions",
            {
                "model": NAME,
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert text == want and finish == ["length"]
        whole = httpx.post(
            url + "/v1/completions",
            json={
                "model": NAME,
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=120,
        ).json()
        assert whole["choices"][0]["text"] == want
    assert httpx.get(url + "/proxy/stats").json() == {
        "requests": 2 * len(PROMPTS),
        "prefill_failures": 0,
    }


def test_prefill_answers_with_transfer_params_and_frees(pd):
    p, d, url = pd
    r = httpx.post(
        p.url + "/v1/completions",
        json={
            "model": NAME,
            "prompt": PROMPTS[1],
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
        timeout=120,
    )
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_agents"] and params["remote_uuid"]
    text, _ = stream_text(
        d.url,
        "/v1/completions",
        {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 4, "kv_transfer_params": params},
    )
    d_metrics = {
        line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in httpx.get(d.url + "/metrics").text.splitlines()
        if line.startswith("jaxkv:kv_transfer")
    }
    assert (
        d_metrics["jaxkv:kv_transfer_bytes_total"] > 0
        and d_metrics["jaxkv:kv_transfer_seconds_total"] > 0
    )
    assert d_metrics["jaxkv:kv_transfer_external_tokens_total"] >= len(params["remote_positions"])
    assert d_metrics["jaxkv:kv_transfer_failed_loads_total"] == 0
    deadline = time.monotonic() + 30  # P polls its sends about once a second when idle
    while True:
        usage = [
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(p.url + "/metrics").text.splitlines()
            if line.startswith("jaxkv:kv_cache_usage_perc")
        ]
        if usage == [0.0]:
            break
        assert time.monotonic() < deadline, f"P still holds blocks: {usage}"
        time.sleep(0.5)


def test_chat_through_proxy(pd, llm):
    p, d, url = pd
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    direct = httpx.post(
        d.url + "/v1/chat/completions", json=body, timeout=120
    ).json()  # D computes it all
    text, finish = stream_text(url, "/v1/chat/completions", body)
    assert text == direct["choices"][0]["message"]["content"] and finish == ["length"]


def test_readme_commands_parse():
    """The README's P/D commands are valid (flags, JSON); the servers above run the same ones."""
    import re
    import shlex

    from jaxkv.distributed.kv_transfer import KVTransferConfig
    from jaxkv.entrypoints.cli import build_parser

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Prefill/decode disaggregation") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    env = dict(re.findall(r"^(\w+)='(.*)'$", block, re.M))
    assert {KVTransferConfig.from_any(v).kv_role for v in env.values()} == {
        "kv_producer",
        "kv_consumer",
    }
    commands = [
        line.split("#")[0].rstrip(" &") for line in block.splitlines() if line.startswith("jaxkv ")
    ]
    assert [c.split()[1] for c in commands] == ["serve", "serve", "proxy"]
    for c in commands:
        for name, value in env.items():
            c = c.replace(f'"${name}"', shlex.quote(value))
        args = build_parser().parse_args(shlex.split(c)[1:])
        assert args.command in ("serve", "proxy")
