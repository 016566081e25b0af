"""The P/D proxy's answers when an instance fails, against scripted instances (an httpx mock
transport; no engine): a prefill 5xx or a dropped prefill connection makes the decode
instance compute the prompt, a prefill 4xx goes back to the client, a decode connection that
broke before any answer is sent once more, an unreachable decode instance is a 502."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from jaxkv.distributed.kv_transfer.proxy import build_app

P, D = "http://p.test", "http://d.test"
BODY = {"model": "m", "prompt": "hi", "max_tokens": 4}


def proxy(p_answer, d_answers):
    """A proxy whose P answers ``p_answer`` (a status, or an exception to raise) and whose D
    answers ``d_answers`` in turn (same); returns (client, the bodies D received)."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        if request.url.host == "p.test":
            answer = p_answer
            if isinstance(answer, Exception):
                raise answer
            return httpx.Response(
                answer,
                json={"kv_transfer_params": {"remote": 1}}
                if answer == 200
                else {"error": {"message": "P says no"}},
            )
        seen.append(body)
        answer = d_answers[min(len(seen), len(d_answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(
            answer,
            headers={"content-type": "application/json"},
            stream=httpx.ByteStream(b'{"choices": [{"text": "ok"}]}'),
        )

    app = build_app([P], [D], transport=httpx.MockTransport(handler))
    return TestClient(app), seen


def test_prefill_parameters_go_to_decode():
    client, seen = proxy(200, [200])
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    assert seen[0]["kv_transfer_params"] == {"remote": 1}
    assert client.get("/proxy/stats").json() == {"requests": 1, "prefill_failures": 0}


@pytest.mark.parametrize(
    "p_answer", [500, 503, httpx.ConnectError("refused"), httpx.RemoteProtocolError("disconnected")]
)
def test_a_failed_prefill_instance_is_skipped(p_answer):
    client, seen = proxy(p_answer, [200])
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    assert "kv_transfer_params" not in seen[0]  # D computes the prompt
    assert client.get("/proxy/stats").json() == {"requests": 1, "prefill_failures": 1}


def test_a_bad_request_gets_the_prefill_instances_error():
    client, seen = proxy(400, [200])
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 400 and r.json()["error"]["message"] == "P says no" and not seen


@pytest.mark.parametrize("stream", [False, True])
def test_decode_connection_broken_before_an_answer_is_retried_once(stream):
    client, seen = proxy(
        200, [httpx.RemoteProtocolError("Server disconnected without sending a response."), 200]
    )
    r = client.post("/v1/completions", json=dict(BODY, stream=stream))
    assert r.status_code == 200 and "ok" in r.text and len(seen) == 2


def test_unreachable_decode_instance_is_a_502():
    client, seen = proxy(200, [httpx.ConnectError("refused")])
    r = client.post("/v1/completions", json=BODY)
    assert (
        r.status_code == 502
        and "decode instance" in r.json()["error"]["message"]
        and len(seen) == 2
    )
