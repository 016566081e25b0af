"""SharedStorageConnector: engine A computes and saves its prompts' full blocks, engine B (another
process) loads them: B's greedy tokens equal a single engine's and B computes only the last
prompt token of each request. Damaged files make B recompute (same tokens, no leaks); pages
of the wrong contents change B's tokens (the loaded KV is what B attends to)."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.distributed.kv_transfer import KVTransferConfig
from tests.distributed.helpers import ENGINE, prompts, run_engine
from tests.engine.helpers import assert_no_block_leaks


def storage(path, role="kv_both", **extra):
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path), **extra},
    }


def damaged_copy(store, dest):
    """A copy of ``store`` with every page file truncated (a load of it fails)."""
    os.makedirs(dest)
    for folder in os.listdir(store):
        os.makedirs(dest / folder)
        for f in glob.glob(str(store / folder / "*")):
            data = open(f, "rb").read()
            open(dest / folder / os.path.basename(f), "wb").write(
                data[: len(data) // 2] if f.endswith(".npz") else data
            )
    return dest


def generate(llm, ps, max_tokens=8):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Engine A saved the workload; returns (store, prompts, a plain engine's tokens)."""
    store = tmp_path_factory.mktemp("kv_store")
    ps = prompts(12)
    a = LLM("tiny-llama", kv_transfer_config=storage(store, "kv_producer"), **ENGINE)
    want = generate(a, ps)
    assert a.llm_engine.engine_core.scheduler.num_external_computed_tokens == 0
    a.shutdown()
    plain = LLM("tiny-llama", **ENGINE)
    assert generate(plain, ps) == want  # saving changes nothing
    plain.shutdown()
    return store, ps, want


def test_other_process_loads_and_computes_only_last_token(saved, tmp_path):
    store, ps, want = saved
    assert len(os.listdir(store)) == len(ps)
    b = run_engine(
        tmp_path,
        "b",
        {"engine": dict(ENGINE, kv_transfer_config=storage(store, "kv_consumer")), "prompts": ps},
    )
    assert b["tokens"] == want
    assert b["cached"] == [len(p) - 1 for p in ps]  # all but the last prompt token
    assert b["external"] == sum(len(p) - 1 for p in ps) and b["failed_loads"] == 0
    assert b["free"] == b["total"]


def test_damaged_files_recompute(saved, tmp_path):
    store, ps, want = saved
    damaged = damaged_copy(store, tmp_path / "damaged")
    b = LLM("tiny-llama", kv_transfer_config=storage(damaged, "kv_consumer"), **ENGINE)
    assert generate(b, ps) == want
    s = b.llm_engine.engine_core.scheduler
    assert s.num_failed_kv_loads == len(ps) and s.num_external_computed_tokens == 0
    assert_no_block_leaks(b)
    b.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_synchronous_loads_and_their_failures(saved, tmp_path, async_scheduling):
    """``load_async: false``: pages load inside the step that computes the last prompt token.
    Loaded: the same tokens, only the last prompt token computed. Every load failing: no
    token sampled over the unwritten pages is returned (the requests recompute from their
    first bad block), the bad blocks are never a prefix hit for the same prompts again, no
    leaks."""
    store, ps, want = saved
    engine = dict(ENGINE, async_scheduling=async_scheduling)
    b = LLM(
        "tiny-llama", kv_transfer_config=storage(store, "kv_consumer", load_async=False), **engine
    )
    assert generate(b, ps) == want
    s = b.llm_engine.engine_core.scheduler
    assert (
        s.num_external_computed_tokens == sum(len(p) - 1 for p in ps) and s.num_failed_kv_loads == 0
    )
    b.shutdown()
    damaged = damaged_copy(store, tmp_path / "damaged")
    b = LLM(
        "tiny-llama", kv_transfer_config=storage(damaged, "kv_consumer", load_async=False), **engine
    )
    assert generate(b, ps) == want
    s = b.llm_engine.engine_core.scheduler
    assert s.num_failed_kv_loads == len(ps)
    assert generate(b, ps) == want  # prefix hits on what was recomputed
    assert s.num_failed_kv_loads == len(ps)  # their full blocks are local hits now: no load
    assert_no_block_leaks(b)
    b.shutdown()


def test_loaded_pages_are_what_is_attended(saved, tmp_path):
    """Pages of the right layout but other contents: B's tokens change (so equal tokens above
    mean the stored KV was used, not recomputed)."""
    store, ps, want = saved
    wrong = tmp_path / "wrong"
    rng = np.random.default_rng(1)
    for folder in os.listdir(store):
        os.makedirs(wrong / folder)
        for f in glob.glob(str(store / folder / "*")):
            name = os.path.basename(f)
            if f.endswith(".npz"):
                with np.load(f) as data:  # random floats of the KV dtype, as bytes
                    np.savez(
                        wrong / folder / name,
                        **{
                            k: rng.standard_normal(v.shape[0] * v.shape[1] // 4)
                            .astype(np.float32)
                            .view(np.uint8)
                            .reshape(v.shape)
                            for k, v in data.items()
                        },
                    )
            else:
                open(wrong / folder / name, "w").write(open(f).read())
    b = LLM("tiny-llama", kv_transfer_config=storage(wrong, "kv_consumer"), **ENGINE)
    got = generate(b, ps)
    assert b.llm_engine.engine_core.scheduler.num_external_computed_tokens == sum(
        len(p) - 1 for p in ps
    )
    assert sum(g != w for g, w in zip(got, want)) >= len(ps) // 2
    assert_no_block_leaks(b)
    b.shutdown()


@pytest.mark.slow
def test_other_layout_never_matches(saved):
    store, ps, want = saved
    b = LLM(
        "tiny-llama",
        kv_transfer_config=storage(store, "kv_consumer"),
        **dict(ENGINE, block_size=32),
    )
    assert generate(b, ps) == want
    assert b.llm_engine.engine_core.scheduler.num_external_computed_tokens == 0
    b.shutdown()


@pytest.mark.slow
def test_hybrid_model_moves_every_group(tmp_path):
    ps = prompts(6, seed=3)
    kt = storage(tmp_path / "store")
    a = LLM("tiny-hybrid", kv_transfer_config=kt, **ENGINE)
    want = generate(a, ps)
    assert len(a.llm_engine.engine_core.scheduler.kv_cache_config.kv_cache_groups) > 1
    a.shutdown()
    b = LLM("tiny-hybrid", kv_transfer_config=kt, enable_prefix_caching=False, **ENGINE)
    assert generate(b, ps) == want
    assert b.llm_engine.engine_core.scheduler.num_external_computed_tokens == sum(
        len(p) - 1 for p in ps
    )
    assert_no_block_leaks(b)
    b.shutdown()


def test_config_errors():
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig("SharedStorageConnector", kv_role="prefill")
    with pytest.raises(ValueError, match="unknown keys"):
        KVTransferConfig.from_any({"kv_connector": "SharedStorageConnector", "kv_rank": 0})
    with pytest.raises(ValueError, match="unknown kv_connector"):
        LLM("tiny-llama", kv_transfer_config={"kv_connector": "NixlConnector"}, **ENGINE)
    with pytest.raises(TypeError, match="load_async"):
        LLM(
            "tiny-llama",
            kv_transfer_config=storage("/tmp/x", "kv_consumer", load_async="no"),
            **ENGINE,
        )


def test_cli_flag_errors(capsys):
    from jaxkv.entrypoints.cli import main

    assert main(["serve", "tiny-llama", "--kv-transfer-config", "{not json"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--kv-transfer-config",
                '{"kv_connector": "SharedStorageConnector", "kv_role": "x"}',
            ]
        )
        == 2
    )
    assert "kv_role" in capsys.readouterr().err
    assert main(["proxy", "--prefill", "http://127.0.0.1:1"]) == 2  # --decode is required


@pytest.mark.slow
def test_async_scheduling_loads_too(saved):
    store, ps, want = saved
    b = LLM(
        "tiny-llama",
        kv_transfer_config=storage(store, "kv_consumer"),
        async_scheduling=True,
        **ENGINE,
    )
    outs = b.generate(
        [{"prompt_token_ids": p} for p in ps],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [len(p) - 1 for p in ps]
    assert_no_block_leaks(b)
    b.shutdown()


@pytest.mark.slow
def test_warm_consumer_compiles_nothing_while_loading(saved):
    """With the default warm-up the page scatters (and gathers) of every bucket are compiled
    at start: loading the saved blocks compiles no program (jax's own compile events)."""
    import jax.monitoring

    store, ps, want = saved
    llm = LLM(
        "tiny-llama", kv_transfer_config=storage(store, "kv_consumer"), **dict(ENGINE, warmup=True)
    )
    compiles = []
    active = [True]

    def on(event, duration, **_):
        if active[0] and event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on)
    try:
        assert generate(llm, ps) == want
    finally:
        active[0] = False
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_external_computed_tokens == sum(len(p) - 1 for p in ps)
    assert compiles == []
    assert_no_block_leaks(llm)
    llm.shutdown()
