"""How ``jaxkv serve`` stops: SIGTERM / SIGINT end the open streams with an error event, shut
the engine core down and remove its IPC directory, exit code 0; a dead engine core stops the
server with exit code 1 and a line in its log; an empty API key is refused at start-up."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_helpers import ROOT, Server, make_model_dir, serve_flags


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


def _start(model_dir, tmp_path, *extra) -> tuple[Server, Path]:
    tmpdir = tmp_path / "tmp"  # the server's TMPDIR: its engine core's IPC directory goes here
    tmpdir.mkdir()
    return Server(
        str(model_dir), serve_flags() + list(extra), tmp_path, env={"TMPDIR": str(tmpdir)}
    ), tmpdir


def _open_stream(server: Server, events: list[str]) -> threading.Thread:
    def read():
        body = {"prompt": "Hi", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not events:  # generating
        assert time.monotonic() < deadline and thread.is_alive(), events
        time.sleep(0.01)
    return thread


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_ends_streams_and_shuts_the_core_down(model_dir, tmp_path, sig):
    server, tmpdir = _start(model_dir, tmp_path)
    try:
        assert [
            p.name for p in tmpdir.iterdir() if p.name.startswith("jaxkv-core-")
        ]  # the core's sockets
        core = server.core_pid()
        streams = [[] for _ in range(8)]  # one may finish before the signal on a busy machine
        readers = [_open_stream(server, events) for events in streams]
        t0 = time.monotonic()
        os.kill(server.pid, sig)
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 < 15
        cut = 0
        for reader, events in zip(readers, streams):
            reader.join(10)
            assert events[-1] == "[DONE]", events[-3:]
            if '"the server is shutting down"' in events[-2]:
                cut += 1
            else:  # it had finished: its last chunk says why
                assert '"finish_reason":"length"' in events[-2].replace(" ", ""), events[-3:]
        assert cut >= 1, [e[-2:] for e in streams]
        assert (
            not Path(f"/proc/{core}").exists()
            or "Z" in Path(f"/proc/{core}/stat").read_text().split()[2]
        )
        assert list(tmpdir.iterdir()) == []  # the IPC directory is gone
        assert "Traceback" not in server.log(100_000)
    finally:
        server.stop()


@pytest.mark.slow
def test_dead_engine_core_stops_the_server(model_dir, tmp_path):
    server, tmpdir = _start(model_dir, tmp_path)
    try:
        os.kill(server.core_pid(), signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert "the engine core died" in server.log()
        assert list(tmpdir.iterdir()) == []
    finally:
        server.stop()


@pytest.mark.parametrize(
    "env,argv",
    [({}, ["--api-key", ""]), ({}, ["--api-key", "  "]), ({"JAXKV_API_KEY": ""}, [])],
    ids=["flag", "blank", "env"],
)
def test_empty_api_key_is_refused_at_startup(monkeypatch, capsys, env, argv):
    from jaxkv.entrypoints.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    assert main(["serve", "tiny-llama", *argv]) == 2
    assert time.monotonic() - t0 < 5  # before anything loads
    assert "--api-key" in capsys.readouterr().err


def test_bad_allowed_hosts_is_refused_at_startup(capsys):
    from jaxkv.entrypoints.cli import main

    assert main(["serve", "tiny-llama", "--allowed-hosts", " "]) == 2
    assert "--allowed-hosts" in capsys.readouterr().err


def test_docs_serving_commands_parse():
    """docs/serving.md's command lines are valid ``jaxkv serve`` invocations."""
    import re
    import shlex

    from jaxkv.entrypoints.cli import build_parser
    from jaxkv.entrypoints.cli_serve import server_options

    text = (ROOT / "docs" / "serving.md").read_text()
    lines = [
        ln
        for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
        for ln in block.splitlines()
        if ln.startswith("jaxkv serve")
    ]
    assert len(lines) == 2
    for line in lines:
        args = build_parser().parse_args(shlex.split(line.replace('"$KEY"', "k"))[1:])
        limits, http = server_options(args)
        assert limits.max_n >= 1 and http.timeout_header_read_s > 0
