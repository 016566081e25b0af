"""Pooling (embedding) requests: LLM.embed / encode / score and LLMEngine.add_request(PoolingParams).

Every pooled vector is checked against the dense, non-paged forward's final-normed hidden
states of the same weights, through chunked prefill, prefix hits, preemption, async
scheduling and batches shared with generation requests.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import (
    EmbeddingRequestOutput,
    PoolerConfig,
    PoolingParams,
    PoolingRequestOutput,
    SamplingParams,
)
from jaxkv.models.dense_reference import dense_hidden
from jaxkv.worker.pooler import PoolAccumulator, finish
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, make_llm, small_model

ATOL = 2e-5


@pytest.fixture(scope="module")
def model():
    return small_model()


@pytest.fixture(scope="module")
def llm(model):
    return make_llm(model, max_num_batched_tokens=48)  # prompts over 48 tokens run in chunks


def _hidden(model, prompt) -> np.ndarray:  # [L, hidden] final-normed, dense forward
    return np.asarray(dense_hidden(model, jnp.asarray([prompt], jnp.int32))[0])


def _pool(h: np.ndarray, kind: str) -> np.ndarray:
    return {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0], "ALL": h}[kind]


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 512, n).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embed_matches_dense_hidden_states_through_chunks(llm, model, kind):
    prompts = _prompts(1, [3, 47, 48, 49, 130])  # one token, around the 48-token budget, 3 chunks
    outs = llm.encode(prompts, PoolingParams(pooling_type=kind, normalize=False), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert isinstance(o, PoolingRequestOutput) and o.finished and o.prompt_token_ids == p
        assert o.outputs.data.shape == (128,) and o.outputs.data.dtype == np.float32
        np.testing.assert_allclose(o.outputs.data, _pool(_hidden(model, p), kind), atol=ATOL)
    assert_no_block_leaks(llm)


def test_token_embed_returns_every_token_normalised(llm, model):
    prompts = _prompts(2, [1, 100])
    outs = llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs.data.shape == (len(p), 128)
        np.testing.assert_allclose(o.outputs.data, _unit(_hidden(model, p)), atol=ATOL)
        np.testing.assert_allclose(np.linalg.norm(o.outputs.data, axis=-1), 1.0, atol=1e-5)


def test_embed_defaults_dimensions_and_score(llm, model):
    prompts = _prompts(3, [20, 60, 9])
    embs = llm.embed(prompts, use_tqdm=False)
    assert all(isinstance(e, EmbeddingRequestOutput) for e in embs)
    for p, e in zip(prompts, embs):  # defaults: LAST, normalised (vLLM's for decoder-only models)
        assert e.outputs.hidden_size == 128
        np.testing.assert_allclose(e.outputs.embedding, _unit(_hidden(model, p)[-1]), atol=ATOL)
    short = llm.embed(prompts[0], PoolingParams(dimensions=16), use_tqdm=False)[
        0
    ]  # truncate, then normalise
    np.testing.assert_allclose(
        short.outputs.embedding, _unit(_hidden(model, prompts[0])[-1][:16]), atol=ATOL
    )
    vecs = [_hidden(model, p)[-1] for p in prompts]
    one_to_n = llm.score(prompts[0], prompts, use_tqdm=False)
    assert one_to_n[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    for s, v in zip(one_to_n, vecs):
        assert s.outputs.score == pytest.approx(float(_unit(vecs[0]) @ _unit(v)), abs=1e-5)
    pairwise = llm.score(prompts[:2], prompts[1:], use_tqdm=False)
    assert [s.outputs.score for s in pairwise] == pytest.approx(
        [float(_unit(vecs[0]) @ _unit(vecs[1])), float(_unit(vecs[1]) @ _unit(vecs[2]))], abs=1e-5
    )
    assert pairwise[0].prompt_token_ids == prompts[0] + prompts[1]
    assert_no_block_leaks(llm)


def test_prefix_hits_for_last_pooling_only(llm, model):
    """LAST pooling reads the prefix cache (its last token is always run); MEAN needs every
    token's hidden state, so it takes no hit (vLLM skips reading the cache there too)."""
    llm.reset_prefix_cache()
    prompt = _prompts(4, [80])[0]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    h = _hidden(model, prompt)
    last = llm.encode([prompt], PoolingParams(normalize=False), use_tqdm=False)[0]
    assert last.num_cached_tokens == 64
    np.testing.assert_allclose(last.outputs.data, h[-1], atol=ATOL)
    mean = llm.encode(
        [prompt], PoolingParams(pooling_type="MEAN", normalize=False), use_tqdm=False
    )[0]
    assert mean.num_cached_tokens == 0
    np.testing.assert_allclose(mean.outputs.data, h.mean(0), atol=ATOL)
    assert_no_block_leaks(llm)


def _mixed_batch(llm, model, prompts):
    """Generation and pooling requests in one engine at once: tokens equal the dense greedy
    loop's, pooled vectors the dense hidden states."""
    engine = llm.llm_engine
    kinds = ["LAST", "MEAN", "CLS", "ALL"]
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        engine.add_request(
            f"p{i}",
            p,
            PoolingParams(
                pooling_type=None if kinds[i % 4] == "ALL" else kinds[i % 4],
                task="token_embed" if kinds[i % 4] == "ALL" else "embed",
                normalize=False,
            ),
        )
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
    for i, p in enumerate(prompts):
        assert done[f"g{i}"].outputs[0].token_ids == dense_greedy(model, p, 6)
        np.testing.assert_allclose(
            done[f"p{i}"].outputs.data, _pool(_hidden(model, p), kinds[i % 4]), atol=ATOL
        )
    assert_no_block_leaks(llm)
    return engine


def test_mixed_with_generation_and_preemption(model):
    # 12 blocks of 16 tokens for 8 requests of up to 90 tokens: requests are preempted.
    small = make_llm(model, num_gpu_blocks_override=13, max_num_batched_tokens=48)
    engine = _mixed_batch(small, model, _prompts(5, [90, 33, 61, 17]))
    assert engine.get_stats().num_preemptions > 0


def test_mixed_with_async_scheduling(model):
    engine = _mixed_batch(
        make_llm(model, async_scheduling=True, max_num_batched_tokens=48),
        model,
        _prompts(6, [50, 5, 70, 24]),
    )
    assert engine.scheduler.async_scheduling


def test_engine_pooler_config_and_runner(model):
    """``pooler_config`` sets the engine's pooling; ``runner`` (vLLM's) "pooling" takes
    pooling requests only and compiles no sampling program at start-up (its forwards and the
    two small update programs); "generate" refuses them."""
    llm = make_llm(
        model,
        pooler_config={"pooling_type": "mean", "normalize": False},
        runner="pooling",
        warmup=True,
    )
    runner = llm.llm_engine.runner
    assert (
        runner.num_compiles
        == len(runner.buckets.tokens) + 2
        == len(runner.program_keys(generate=False))
    )
    p = _prompts(7, [30])[0]
    out = llm.embed(p, use_tqdm=False)[0]
    np.testing.assert_allclose(out.outputs.embedding, _hidden(model, p).mean(0), atol=ATOL)
    with pytest.raises(ValueError, match="runner='pooling': it takes no SamplingParams"):
        llm.generate([p], use_tqdm=False)
    gen = make_llm(model, runner="generate")
    with pytest.raises(ValueError, match="runner='generate': it takes no PoolingParams"):
        gen.embed([p], use_tqdm=False)
    with pytest.raises(ValueError, match="runner must be one of"):
        make_llm(model, runner="embed")
    assert_no_block_leaks(llm)
    assert_no_block_leaks(gen)


def test_bad_pooling_input_is_refused_and_engine_stays_usable(llm, model):
    with pytest.raises(ValueError, match="classify"):
        PoolingParams(task="classify")
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams(pooling_type="max")
    with pytest.raises(ValueError, match="token_embed"):
        PoolingParams(task="embed", pooling_type="ALL")
    with pytest.raises(TypeError, match="normalize"):
        PoolingParams(normalize=1)
    with pytest.raises(ValueError, match="ALL"):
        PoolerConfig(pooling_type="ALL")
    with pytest.raises(TypeError, match="pooler_config"):
        make_llm(model, pooler_config="mean")
    ok = _prompts(8, [10])[0]
    with pytest.raises(ValueError, match="hidden size 128"):
        llm.embed([ok, ok], PoolingParams(dimensions=129), use_tqdm=False)
    with pytest.raises(ValueError, match=r"600 tokens is longer than 511 \(max_model_len=512\)"):
        llm.embed([ok, [1] * 600], use_tqdm=False)  # the first is aborted again
    with pytest.raises(ValueError, match=r"512 tokens is longer than 511"):  # all must run
        llm.embed([[1] * 512], use_tqdm=False)
    with pytest.raises(ValueError, match=r"600 tokens is longer than 512 \(max_model_len=512\)"):
        llm.generate([[1] * 600], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed([[5, 512]], use_tqdm=False)
    with pytest.raises(ValueError, match="'embed' call"):
        llm.embed([ok], PoolingParams(task="token_embed"), use_tqdm=False)
    with pytest.raises(TypeError, match="pooling_params must be PoolingParams"):
        llm.encode([ok], SamplingParams(), use_tqdm=False)
    with pytest.raises(TypeError, match="PoolingParams"):
        llm.llm_engine.add_request("x", ok, params="embed")
    with pytest.raises(ValueError, match="one prompt with N"):
        llm.score([ok, ok], [ok, ok, ok], use_tqdm=False)
    assert_no_block_leaks(llm)
    engine = llm.llm_engine  # aborted between two chunks of its prompt: no output, no leak
    engine.add_request("aborted", [3] * 130, PoolingParams(pooling_type="MEAN"))
    assert engine.step() == []
    engine.abort_request("aborted")
    assert not engine.has_unfinished_requests()
    assert_no_block_leaks(llm)
    out = llm.encode(
        [ok], PoolingParams(truncate_prompt_tokens=4, normalize=False), use_tqdm=False
    )[0]
    assert out.prompt_token_ids == ok[-4:]
    np.testing.assert_allclose(out.outputs.data, _hidden(model, ok[-4:])[-1], atol=ATOL)
    assert_no_block_leaks(llm)


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(1, 40),
    data=st.data(),
    kind=st.sampled_from(["LAST", "MEAN", "CLS", "ALL"]),
    normalize=st.booleans(),
    dims=st.one_of(st.none(), st.integers(1, 6)),
)
def test_accumulator_over_any_chunking_and_restarts(length, data, kind, normalize, dims):
    """Host side: whatever the chunks, and after restarts from position 0 (preemption), the
    finished vector is the pooling of the whole prompt."""
    h = np.random.default_rng(length).standard_normal((length, 6)).astype(np.float32)
    params = PoolingParams(
        pooling_type=None if kind == "ALL" else kind,
        normalize=normalize,
        dimensions=dims,
        task="token_embed" if kind == "ALL" else "embed",
    ).resolved(PoolerConfig(), 6)
    acc = PoolAccumulator(params, length)
    restarts = data.draw(st.integers(0, 2))
    result = None
    for attempt in range(restarts + 1):
        pos = 0
        stop = data.draw(st.integers(1, length)) if attempt < restarts else length
        while pos < stop:
            q = data.draw(st.integers(1, stop - pos))
            # the step: this row's q tokens start at token 3 of a step of T = 3 + q + 2 tokens
            result = acc.add(h[pos : pos + q], pos)
            assert (result is None) == (pos + q < length)
            pos += q
    np.testing.assert_allclose(result, finish(_pool(h, kind), params), atol=1e-5)


def test_mixed_with_speculative_decoding(model):
    """Pooling rows never take drafts; the generation rows beside them accept theirs."""
    llm = make_llm(
        model,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        },
    )
    engine = _mixed_batch(llm, model, [([7, 8, 9] * 20)[:n] for n in (40, 20, 55, 9)])
    assert engine.get_stats().spec_decode.num_accepted_tokens > 0


def test_hybrid_model_sliding_windows_and_soft_caps():
    """The Gemma-2-style hybrid (sliding-window layers, soft-caps) pools through chunks too."""
    hybrid = small_model("tiny-hybrid")
    llm = make_llm(hybrid, max_num_batched_tokens=48)
    prompts = _prompts(10, [5, 70, 130])  # beyond the 16-token window, in 1-3 chunks
    for kind in ("LAST", "MEAN"):
        outs = llm.encode(
            prompts, PoolingParams(pooling_type=kind, normalize=False), use_tqdm=False
        )
        for p, o in zip(prompts, outs):
            np.testing.assert_allclose(o.outputs.data, _pool(_hidden(hybrid, p), kind), atol=ATOL)
    assert_no_block_leaks(llm)
