"""``jaxkv serve`` end to end with the official ``openai`` client: one server for the module
(a 2-layer model with a tokenizer, random weights), compared with ``LLM`` on the same model
and settings. Greedy streams concatenate to the non-streamed text; logprobs and embeddings
equal the offline engine's; every bad parameter is a 400 naming it and the server keeps
serving; disconnecting clients leave no request and no block behind."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from tests.entrypoints.server_helpers import ENGINE, ROOT, Server, make_model_dir, serve_flags  # noqa: E402

NAME = "tiny-chat"
KEY = "test-key"
PROMPT = "hello the world"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(
        str(model_dir),
        serve_flags()
        + [
            "--served-model-name",
            NAME,
            "smollm2-135m-instruct",
            "--api-key",
            KEY,
            "--keep-serving-on-core-death",
        ],
        tmp_path_factory.mktemp("serve"),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def llm(model_dir):
    from jaxkv import LLM

    return LLM(str(model_dir), **ENGINE)


def _post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[
                name.split("{")[0] + ("{" + name.split("{")[1] if "finished_reason" in name else "")
            ] = float(value)
    return out


# ---- completions ---------------------------------------------------------------------------------


def test_completion_streamed_equals_whole_equals_llm(client, llm):
    from jaxkv import SamplingParams

    whole = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3
    )
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, logprobs=3))[0]
    (choice,) = whole.choices
    assert choice.text == ref.outputs[0].text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    n_prompt, n_out = len(ref.prompt_token_ids), len(ref.outputs[0].token_ids)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (n_prompt, n_out)
    assert whole.usage.total_tokens == n_prompt + n_out
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_out
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    # logprobs: the sampled tokens' and the top 3 (plus the sampled one), as LLM.generate's
    ref_lps = ref.outputs[0].logprobs
    assert choice.logprobs.token_logprobs == [
        p[t].logprob for p, t in zip(ref_lps, ref.outputs[0].token_ids)
    ]
    # keyed by token text, as OpenAI's format is (ids that decode alike share a key)
    assert choice.logprobs.top_logprobs == [
        {lp.decoded_token: lp.logprob for lp in p.values()} for p in ref_lps
    ]
    streamed = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == choice.logprobs.token_logprobs


def test_echo_n3_and_batched_prompts(client, llm):
    from jaxkv import SamplingParams

    out = client.completions.create(
        model=NAME, prompt=[PROMPT, "12 + 3"], n=3, max_tokens=6, temperature=1.0, seed=7, echo=True
    )
    assert sorted(c.index for c in out.choices) == list(range(6))
    ref = llm.generate(
        [PROMPT, "12 + 3"], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7)
    )
    tok = llm.get_tokenizer()
    for c in out.choices:
        r = ref[c.index // 3]
        prompt_text = r.prompt if r.prompt is not None else tok.decode(r.prompt_token_ids)
        assert c.text == prompt_text + r.outputs[c.index % 3].text
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert out.usage.completion_tokens == sum(len(o.token_ids) for r in ref for o in r.outputs)
    # streamed with the same seed: each choice's deltas concatenate to its whole text
    texts: dict[int, str] = {}
    for chunk in client.completions.create(
        model=NAME, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=7, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {i: ref[0].outputs[i].text for i in range(3)}


def test_stop_string(client):
    text = (
        client.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = next(ch for ch in text[2:] if ch.strip() and ch != "\ufffd")
    cut = client.completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    assert cut.model_extra["stop_reason"] == stop


# ---- chat ----------------------------------------------------------------------------------------


def test_chat_streamed_equals_whole_equals_llm(client, llm):
    from jaxkv import SamplingParams

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    ref = llm.chat(messages, SamplingParams(max_tokens=10, temperature=0, logprobs=3))[0]
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == choice.message.content
    )
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids) == chunks[-1].usage.prompt_tokens
    assert whole.usage.completion_tokens == len(ref.outputs[0].token_ids)
    ref_lps = ref.outputs[0].logprobs
    assert [t.logprob for t in choice.logprobs.content] == [
        p[t].logprob for p, t in zip(ref_lps, ref.outputs[0].token_ids)
    ]
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)


# ---- embeddings, tokenizer, models, metrics ------------------------------------------------------


def test_embeddings_equal_llm_embed(client, llm):
    texts = ["hello the world", "12 + 3"]
    base64 = client.embeddings.create(model=NAME, input=texts)  # the client asks for base64
    floats = client.embeddings.create(model=NAME, input=texts, encoding_format="float")
    ref = llm.embed(texts)
    for got_b, got_f, want in zip(base64.data, floats.data, ref):
        np.testing.assert_allclose(got_b.embedding, want.outputs.embedding, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got_f.embedding, want.outputs.embedding, rtol=0, atol=1e-6)
    assert base64.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    short = client.embeddings.create(
        model=NAME, input=texts[0], dimensions=8, encoding_format="float"
    )
    assert len(short.data[0].embedding) == 8


def test_models_tokenize_detokenize_health(client, server, llm):
    assert [m.id for m in client.models.list().data] == [NAME, "smollm2-135m-instruct"]
    tok = llm.get_tokenizer()
    r = _post(server, "/tokenize", {"prompt": PROMPT}).json()
    assert (
        r["tokens"] == tok.encode(PROMPT)
        and r["count"] == len(r["tokens"])
        and r["max_model_len"] == 128
    )
    assert _post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=False
    )
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_api_key_and_unknown_model(server, client):
    for key in (None, "wrong"):
        r = _post(
            server, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 1}, key=key
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # no key needed


def test_metrics_after_requests(server, client):
    for _ in range(2):  # 40 tokens: the second run hits the first's two full blocks
        client.completions.create(
            model=NAME, prompt=list(range(5, 45)), max_tokens=4, temperature=0
        )
    m = _metrics(server)
    assert m["jaxkv:num_requests_running"] == 0 and m["jaxkv:num_requests_waiting"] == 0
    assert m["jaxkv:kv_cache_usage_perc"] == 0
    assert m["jaxkv:generation_tokens_total"] >= 4 and m["jaxkv:prompt_tokens_total"] >= 7
    assert m["jaxkv:time_to_first_token_seconds_count"] >= 1
    assert m["jaxkv:inter_token_latency_seconds_count"] >= 3
    assert m["jaxkv:prefix_cache_queries_total"] >= m["jaxkv:prefix_cache_hits_total"] > 0
    for name in ("jaxkv:num_preemptions_total", "jaxkv:prefix_cache_hit_rate"):
        assert name in m


def test_nothing_compiles_while_serving(server, client, llm):
    """Warm-up (the default) compiled every program before /health answered: requests of every
    kind (sampling features, n > 1, stops, logprobs, prompt logprobs, chat, embeddings) compile
    none. ``jaxkv:compiles_total`` counts every program the core compiled since start."""
    programs = llm.llm_engine.get_stats().num_programs
    assert _metrics(server)["jaxkv:compiles_total"] == programs > 10
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8, top_p=0.9, seed=3, extra_body={"top_k": 20}),
        dict(
            temperature=1.0,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            n=2,
            extra_body={"min_p": 0.1},
        ),
        dict(temperature=0, logprobs=3, echo=True, max_tokens=1),
        dict(temperature=0, stop=["e"]),
        dict(
            temperature=0.7,
            logit_bias={"7": 5.0},
            extra_body={"repetition_penalty": 1.2, "min_tokens": 3, "prompt_logprobs": 2},
        ),
    ]
    for i, kw in enumerate(kinds):
        kw.setdefault("max_tokens", 6)
        client.completions.create(model=NAME, prompt=list(range(3, 3 + 10 * (i + 1))), **kw)
    client.chat.completions.create(model=NAME, messages=MSG, max_tokens=4, temperature=0)
    client.embeddings.create(model=NAME, input=["hello world", "the"])
    m = _metrics(server)
    assert m["jaxkv:compiles_total"] == programs, "a program compiled while serving"


# ---- bad requests --------------------------------------------------------------------------------

C, CHAT, EMB = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
MSG = [{"role": "user", "content": "hi"}]
BAD = [  # (path, the bad part of the body, what the message must name)
    (C, {"temperature": -1}, "temperature"),
    (C, {"temperature": "hot"}, "temperature"),
    (C, {"top_p": 0}, "top_p"),
    (C, {"top_p": 1.5}, "top_p"),
    (C, {"top_k": -5}, "top_k"),
    (C, {"top_k": 100000}, "top_k"),
    (C, {"top_k": "x"}, "top_k"),
    (C, {"min_p": 2}, "min_p"),
    (C, {"n": 0}, "n"),
    (C, {"n": 1.5}, "n"),
    (C, {"n": True}, "n"),
    (C, {"max_tokens": 0}, "max_tokens"),
    (C, {"max_tokens": -1}, "max_tokens"),
    (C, {"max_tokens": 10**6}, "max_tokens"),
    (C, {"max_tokens": "a"}, "max_tokens"),
    (C, {"seed": "x"}, "seed"),
    (C, {"seed": 2**70}, "seed"),
    (C, {"stop": [1]}, "stop"),
    (C, {"stop": [""]}, "stop"),
    (C, {"presence_penalty": 3}, "presence_penalty"),
    (C, {"frequency_penalty": -3}, "frequency_penalty"),
    (C, {"repetition_penalty": 0}, "repetition_penalty"),
    (C, {"logit_bias": {"x": 1}}, "logit_bias"),
    (C, {"logit_bias": {"999999": 1}}, "logit_bias"),
    (C, {"logit_bias": {"5": "a"}}, "logit_bias"),
    (C, {"logprobs": 100}, "logprobs"),
    (C, {"logprobs": -2}, "logprobs"),
    (C, {"prompt": []}, "prompt"),
    (C, {"prompt": [999999]}, "prompt"),
    (C, {"prompt": 5}, "prompt"),
    (C, {"stream": "yes"}, "stream"),
    (C, {"echo": 1}, "echo"),
    (C, {"stream_options": {"include_usage": "x"}}, "include_usage"),
    (C, {"min_tokens": 50, "max_tokens": 4}, "min_tokens"),
    (C, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (C, {"best_of": 3}, "best_of"),
    (C, {"suffix": "x"}, "suffix"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"content": "x"}]}, "role"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 30}, "logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 10**6}, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "temperature": -0.5}, "temperature"),
    (EMB, {"input": []}, "input"),
    (EMB, {"input": "hi", "dimensions": 0}, "dimensions"),
    (EMB, {"input": "hi", "dimensions": 10**6}, "dimensions"),
    (EMB, {"input": [[]]}, "empty"),
    (EMB, {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


def _base(path: str) -> dict:
    return {
        C: {"model": NAME, "prompt": "hi", "max_tokens": 2},
        CHAT: {"model": NAME, "max_tokens": 2},
        EMB: {"model": NAME},
    }.get(path, {})


@pytest.mark.parametrize(
    "path,bad,named",
    BAD,
    ids=[f"{p.split('/')[-2 if p == CHAT else -1]}-{json.dumps(b)[:40]}" for p, b, _ in BAD],
)
def test_bad_parameter_is_a_400_naming_it(server, path, bad, named):
    r = _post(server, path, {**_base(path), **bad})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert named in error["message"], error


def test_bad_json_and_server_keeps_serving(server, client):
    r = httpx.post(
        f"{server.url}{C}",
        content=b"{not json",
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "json" in r.json()["error"]["message"].lower()
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=NAME, prompt="hi", top_p=7)
    assert (
        client.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens
        >= 1
    )
    m = _metrics(server)
    assert m["jaxkv:num_requests_running"] == 0 and m["jaxkv:kv_cache_usage_perc"] == 0


def test_disconnected_whole_request_is_aborted(server):
    """A non-streamed request whose client goes away mid-generation stops in the core."""
    import socket

    before = _metrics(server)["jaxkv:generation_tokens_total"]
    body = json.dumps(
        {"model": NAME, "prompt": "hi", "max_tokens": 120, "ignore_eos": True}
    ).encode()
    head = (
        f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 60
        while _metrics(server)["jaxkv:num_requests_running"] == 0:  # generating now
            assert time.monotonic() < deadline
            time.sleep(0.02)
    deadline = time.monotonic() + 30
    while (m := _metrics(server))["jaxkv:num_requests_running"] or m["jaxkv:kv_cache_usage_perc"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["jaxkv:generation_tokens_total"] - before < 120  # stopped early, blocks freed


# ---- load: concurrent streams, random disconnects ------------------------------------------------


def test_64_streaming_clients_with_disconnects_leave_nothing(server):
    rng = random.Random(0)

    async def one(http, i):
        body = {
            "model": NAME,
            "prompt": [rng.randrange(3, 280) for _ in range(rng.randrange(4, 20))],
            "max_tokens": rng.randrange(4, 16),
            "temperature": 1.0,
            "stream": True,
            "ignore_eos": True,
        }
        leave_after = rng.choice([None, 0, 1, 3])  # chunks read before disconnecting
        async with http.stream("POST", f"{server.url}{C}", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if leave_after is not None and n > leave_after:
                        return "left"
            return "done"

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            timeout=180, limits=limits, headers={"Authorization": f"Bearer {KEY}"}
        ) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(64))), 180)

    results = asyncio.run(run())
    assert results.count("done") > 0 and results.count("left") > 0
    deadline = time.monotonic() + 30
    while True:  # the aborts reach the core within a step or two
        m = _metrics(server)
        if (
            m["jaxkv:num_requests_running"],
            m["jaxkv:num_requests_waiting"],
            m["jaxkv:kv_cache_usage_perc"],
        ) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.5)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# ---- the README's serve example, against this server ------------------------------------------


def _readme_blocks() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Serving over HTTP") :]
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return bash, python


def test_readme_serve_example(server, capsys):
    from jaxkv.entrypoints.cli import build_parser

    bash, python = _readme_blocks()
    serve_line, curl = bash.split("\n", 1)
    args = build_parser().parse_args(shlex.split(serve_line.split("#")[0])[1:])  # the flags parse
    assert args.model == "smollm2-135m-instruct" and (args.host, args.port) == ("127.0.0.1", 8000)
    readme_url = "http://127.0.0.1:8000"
    if shutil.which("curl"):  # the model is served here under the same name (and a key)
        cmd = (
            curl.strip().replace(readme_url, server.url).replace("\\\n", " ")
            + f' -H "Authorization: Bearer {KEY}"'
        )
        done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
        body = json.loads(done.stdout)
        assert (
            body["object"] == "text_completion" and 1 <= body["usage"]["completion_tokens"] <= 8
        ), body
    scope: dict = {}
    exec(
        compile(
            python.replace(readme_url, server.url).replace('"EMPTY"', repr(KEY)),
            "README.md",
            "exec",
        ),
        scope,
    )
    assert 1 <= scope["completion"].usage.completion_tokens <= 8
    assert scope["chunk"].choices[0].finish_reason in ("stop", "length")
    assert "CompletionUsage" in capsys.readouterr().out


# ---- faults: the last test, it kills the module's engine core ------------------------------------


def test_killed_engine_core_is_a_503_and_health_fails(server):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 100, "ignore_eos": True}
    answer: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: answer.append(_post(server, C, body)), daemon=True)
    waiting.start()
    deadline = time.monotonic() + 60
    while _metrics(server)["jaxkv:num_requests_running"] == 0:  # the request is in the core
        assert time.monotonic() < deadline and waiting.is_alive(), [
            (a.status_code, a.text[:300]) for a in answer
        ]
        time.sleep(0.05)
    os.kill(server.core_pid(), signal.SIGKILL)
    t0 = time.monotonic()
    waiting.join(20)
    assert not waiting.is_alive() and time.monotonic() - t0 < 10
    assert answer[0].status_code == 503 and "engine" in answer[0].json()["error"]["message"]
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503, health.text
    r = _post(server, C, {"model": NAME, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    with httpx.stream(
        "POST",
        f"{server.url}{C}",
        json={**body, "stream": True},
        timeout=10,
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        assert r.status_code == 503
