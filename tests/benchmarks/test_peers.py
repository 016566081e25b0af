"""benchmarks/peers.py's parts that run without the peers' environments (not a timed test).

* peer_weights: a Q4_1/Q8_0 llama GGUF (written the way llama.cpp's converter writes) becomes an
  HF directory and an F32 GGUF holding the same float32 numbers: jaxkv's logits from either
  equal those from the source file.
* peer_worker's llama.cpp loop (continuous batching, chunked prompts, a shared prefix copied
  between sequences, slots reused) on a fake ``llama_cpp`` module whose "model" predicts from
  exactly the tokens at positions 0..pos of the sequence's KV cells: every request's tokens
  must equal the same model run one request at a time, so a wrong position, sequence id,
  logits row or prefix copy changes them.
* the orchestrator's workloads, metrics and agreement, and one --quick run with jaxkv alone
  on the real model (slow).
"""

from __future__ import annotations

import json
import pathlib
import sys
import types

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "models"))

import peer_weights  # noqa: E402
import peer_worker  # noqa: E402
import peers  # noqa: E402
from ckpt_fixtures import hf_config_dict, small_config, write_llama_gguf  # noqa: E402

from jaxkv.models import build_model, dense_forward, hf_state_dict  # noqa: E402
from jaxkv.models.registry import load_model  # noqa: E402

Q = gguf.GGMLQuantizationType


def test_weights_same_numbers_for_every_engine(tmp_path):
    config = small_config()
    tensors = hf_state_dict(build_model(config, seed=3))
    quantize = {
        name: Q.Q4_1 if "mlp" in name else Q.Q8_0
        for name in tensors
        if name.endswith("proj.weight")
    }
    src = tmp_path / "src.gguf"
    write_llama_gguf(src, hf_config_dict(config), tensors, quantize=quantize)
    w = peer_weights.prepare(tmp_path / "out", source=src)
    assert peer_weights.check(w) == len(tensors)
    assert w.vocab_size == config.vocab_size
    reader = gguf.GGUFReader(str(w.gguf_path))
    assert {t.tensor_type for t in reader.tensors} == {Q.F32}
    assert reader.fields["general.file_type"].parts[-1][0] == 0  # ALL_F32
    ids = jnp.asarray([[1, 5, 9, 200, 3, 77, 12, 8]], jnp.int32)
    want = np.asarray(dense_forward(load_model(src)[0], ids))
    for path in (w.hf_dir, w.gguf_path):
        np.testing.assert_array_equal(np.asarray(dense_forward(load_model(path)[0], ids)), want)
    mtime = (w.hf_dir / "model.safetensors").stat().st_mtime_ns
    peer_weights.prepare(tmp_path / "out", source=src)  # reused, not rewritten
    assert (w.hf_dir / "model.safetensors").stat().st_mtime_ns == mtime


# ---- llama.cpp's loop on a fake llama_cpp ------------------------------------------------------

VOCAB = 50


def _predict(tokens: list[int]) -> int:
    """The fake model: the next token is a hash of the whole context."""
    h = 7
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


class _FakeBatch:
    def __init__(self, n, n_seq):
        self.token = [0] * n
        self.pos = [0] * n
        self.n_seq_id = [0] * n
        self.seq_id = [[0] * n_seq for _ in range(n)]
        self.logits = [False] * n
        self.n_tokens = 0


def fake_llama_cpp(n_parallel_seen: list) -> types.ModuleType:
    lc = types.ModuleType("llama_cpp")
    state = {"cells": {}, "logits": None}  # cells: seq -> {pos: token}

    class Params:
        type_k = 1  # llama.cpp's default, GGML_TYPE_F16
        flash_attn_type = -1

    def decode(ctx, b):
        assert b.n_tokens <= len(b.token)
        rows = []
        for j in range(b.n_tokens):  # the whole batch lands in the cache first
            for k in range(b.n_seq_id[j]):
                cells = state["cells"].setdefault(b.seq_id[j][k], {})
                assert b.pos[j] not in cells, "a position written twice"
                cells[b.pos[j]] = b.token[j]
        for j in range(b.n_tokens):
            if b.logits[j]:
                cells = state["cells"][b.seq_id[j][0]]
                assert sorted(cells)[: b.pos[j] + 1] == list(range(b.pos[j] + 1)), (
                    "a hole in the context"
                )
                row = np.zeros(VOCAB, np.float32)
                row[_predict([cells[p] for p in range(b.pos[j] + 1)])] = 1.0
                rows.append(row)
        state["logits"] = np.stack(rows) if rows else None
        return 0

    def seq_cp(mem, src, dst, p0, p1):
        p1 = float("inf") if p1 < 0 else p1  # llama.cpp: negative bounds mean "all"
        cells = state["cells"].setdefault(dst, {})
        cells.update({p: t for p, t in state["cells"][src].items() if max(p0, 0) <= p < p1})

    def seq_rm(mem, seq, p0, p1):
        assert (p0, p1) == (-1, -1)
        state["cells"].pop(seq, None)

    def context_params():
        return Params()

    def init_from_model(model, params):
        n_parallel_seen.append(params.n_seq_max - 1)
        return object()

    lc.llama_backend_init = lambda: None
    lc.llama_model_default_params = Params
    lc.llama_model_load_from_file = lambda path, p: object()
    lc.llama_context_default_params = context_params
    lc.llama_init_from_model = init_from_model
    lc.llama_model_get_vocab = lambda m: None
    lc.llama_vocab_n_tokens = lambda v: VOCAB
    lc.llama_batch_init = lambda n, embd, n_seq: _FakeBatch(n, n_seq)
    lc.llama_decode = decode
    lc.llama_get_logits = lambda ctx: state["logits"]
    lc.llama_get_memory = lambda ctx: None
    lc.llama_memory_clear = lambda mem, data: state["cells"].clear()
    lc.llama_memory_seq_cp = seq_cp
    lc.llama_memory_seq_rm = seq_rm
    lc.state = state
    return lc


def _reference(req) -> list[int]:
    ctx, out = list(req["prompt"]), []
    for _ in range(req["max_tokens"]):
        out.append(_predict(ctx))
        ctx.append(out[-1])
    return out


@pytest.mark.parametrize(
    "shared,n_parallel,n_batch,unified",
    [(0, 64, 2048, False), (13, 64, 16, False), (13, 3, 7, True), (0, 2, 5, True)],
)
def test_llamacpp_loop_matches_one_at_a_time(monkeypatch, shared, n_parallel, n_batch, unified):
    seen = []
    lc = fake_llama_cpp(seen)
    monkeypatch.setitem(sys.modules, "llama_cpp", lc)
    monkeypatch.setattr(np.ctypeslib, "as_array", lambda ptr, shape: ptr.reshape(shape))
    rng = np.random.default_rng(shared + n_parallel)
    prefix = rng.integers(0, VOCAB, shared).tolist()
    reqs = [
        {
            "prompt": prefix + rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist(),
            "max_tokens": int(rng.integers(1, 9)),
        }
        for _ in range(9)
    ]
    spec = {
        "gguf_path": "x.gguf",
        "threads": 2,
        "workloads": {"w": reqs},
        "llamacpp_options": {"n_parallel": n_parallel, "n_batch": n_batch, "kv_unified": unified},
    }
    engine = peer_worker.LlamaCppEngine(spec)
    assert seen == [n_parallel]
    for _ in range(2):  # the second run starts from an emptied cache
        res = engine.run(reqs)
        assert res["tokens"] == [_reference(r) for r in reqs]
        assert all(a is not None and b >= a for a, b in zip(res["first_s"], res["last_s"]))
    single = engine.run(reqs[:1])
    assert single["tokens"] == [_reference(reqs[0])]


# ---- the orchestrator ---------------------------------------------------------------------------


def test_workloads_are_seeded_and_sized():
    a = peers.make_workloads(peers.WORKLOADS, peers.FULL, 49152, seed=0)
    b = peers.make_workloads(peers.WORKLOADS, peers.FULL, 49152, seed=0)
    assert a == b
    assert a != peers.make_workloads(peers.WORKLOADS, peers.FULL, 49152, seed=1)
    assert [len(a[w]) for w in peers.WORKLOADS] == [64, 1, 64, 64]
    assert all(32 <= len(r["prompt"]) <= 256 and r["max_tokens"] == 64 for r in a["fixed"])
    assert len(a["batch1"][0]["prompt"]) == 128 and a["batch1"][0]["max_tokens"] == 256
    first = a["shared-prefix"][0]["prompt"][:1024]
    assert all(
        r["prompt"][:1024] == first and 1056 <= len(r["prompt"]) <= 1152 for r in a["shared-prefix"]
    )
    assert peer_worker._common_prefix([r["prompt"] for r in a["shared-prefix"]]) >= 1024
    assert all(16 <= r["max_tokens"] <= 256 and 32 <= len(r["prompt"]) <= 512 for r in a["mixed"])
    assert min(t for w in a.values() for r in w for t in r["prompt"]) >= 100


def test_metrics_and_agreement():
    reqs = [{"max_tokens": 3}, {"max_tokens": 1}]
    res = {
        "elapsed_s": 2.0,
        "tokens": [[1, 2, 3], [4]],
        "first_s": [0.5, 0.1],
        "last_s": [1.5, 0.1],
    }
    m = peers.pass_metrics(res, reqs)
    assert (
        m["output_tok_s"] == 2.0
        and m["ttft_ms"] == pytest.approx(300.0)
        and m["tpot_ms"] == pytest.approx(500.0)
    )
    with pytest.raises(RuntimeError, match="request 1 got 1 tokens, asked for 2"):
        peers.pass_metrics(res, [{"max_tokens": 3}, {"max_tokens": 2}])
    ag = peers.agreement([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9], [7]])
    assert ag == {"equal": 1, "requests": 3, "first_divergence": [0, 1]}
    assert peers.spread([3.0, None, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}


def test_bad_arguments_exit_2(capsys):
    for argv in (["--engines", "jaxkv,sglang"], ["--workloads", "fixed,huge"], ["--passes", "0"]):
        with pytest.raises(SystemExit) as e:
            peers.parse_args(argv)
        assert e.value.code == 2
    assert "unknown engine 'sglang'" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_run_jaxkv_alone(tmp_path):
    try:
        from jaxkv.models.checkpoint import smollm2_gguf_path

        smollm2_gguf_path()
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 download failed: {e}")
    out = tmp_path / "peers.json"
    payload = peers.main(
        [
            "--quick",
            "--engines",
            "jaxkv",
            "--passes",
            "2",
            "--workloads",
            "batch1,shared-prefix",
            "--root",
            str(tmp_path / "root"),
            "--no-install",
            "--kv-cache-gib",
            "1",
            "--json",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["summary"] == json.loads(json.dumps(payload["summary"]))
    for w in ("batch1", "shared-prefix"):
        per = saved["summary"][w]["engines"]["jaxkv"]
        assert (
            0
            < per["output_tok_s"]["min"]
            <= per["output_tok_s"]["median"]
            <= per["output_tok_s"]["max"]
        )
        assert len(saved["passes"][w]["jaxkv"]) == 2
    assert saved["config"]["engines"]["jaxkv"]["options"]["dtype"] == "float32"
    assert "cpu" in saved["config"] and out.with_suffix(".log").is_file()
