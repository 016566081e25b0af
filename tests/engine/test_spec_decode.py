"""Speculative decoding (n-gram drafts) end to end: greedy outputs equal the dense forward's,
other rows of the batch are untouched, limits hold, no block leaks."""

import numpy as np
import pytest

from jaxkv.engine import LLMEngine
from jaxkv.sampling_params import SamplingParams
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, make_llm, small_model

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


@pytest.fixture(scope="module")
def models():
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = small_model(family)
        return built[family]

    return get


@pytest.fixture(scope="module")
def llama(models):  # the tests that do not depend on the layer kinds run on one family
    return models("tiny-llama")


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    loop = rng.integers(3, 512, size=6).tolist()
    # repeating prompts give the lookup something to find; random ones mostly do not
    return [
        loop * 4,
        rng.integers(3, 512, size=21).tolist(),
        loop[:3] * 5 + [7],
        rng.integers(3, 512, size=40).tolist(),
    ]


PREEMPTING = dict(num_gpu_blocks_override=12, max_num_seqs=4)


@pytest.mark.parametrize(
    "family, settings",
    [
        ("tiny-llama", dict()),
        ("tiny-llama", PREEMPTING),
        ("tiny-llama", dict(max_num_batched_tokens=16, max_num_seqs=4)),
        (
            "tiny-hybrid",
            PREEMPTING,
        ),  # sliding-window layers: blocks leave the window as drafts come and go
    ],
    ids=["llama-plain", "llama-preempting", "llama-budget-16", "hybrid-preempting"],
)
def test_greedy_with_drafts_equals_dense(models, family, settings):
    """Accepted and rejected drafts both occur; outputs are the dense greedy ones, with
    preemption (drafts recomputed) and with a token budget that cuts drafts short."""
    model = models(family)
    prompts = _prompts(0)
    llm = make_llm(model, speculative_config=SPEC, **settings)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False
    )
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == dense_greedy(model, p, 20)
    st = llm.llm_engine.get_stats()
    assert 0 < st.spec_decode.num_accepted_tokens < st.spec_decode.num_draft_tokens, st
    if "num_gpu_blocks_override" in settings:
        assert st.num_preemptions > 0
    assert_no_block_leaks(llm)


def test_rows_without_drafts_and_limits_match_the_engine_without_speculation(llama):
    """A batch of drafted rows with penalties, bad words, min_tokens, logprobs, stop ids and
    max_tokens cutting accepted drafts: the same outputs as without drafts (each scored position sees
    the drafts before it in its penalties and bad words), and the same logprobs at every
    position. Then seeded sampling with drafts is reproducible."""
    loop, noise, short_loop, longer = _prompts(0)
    prompts = [short_loop, noise, longer, loop, loop, loop, loop, loop]
    model = llama
    free = dense_greedy(model, short_loop, 12)  # repeats tokens early: drafts get accepted
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[free[9]]),
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3),
        # a negative frequency penalty makes loop's output repeat 14 (drafts accepted);
        # the bad word [14, 14, 14] turns that into the cycle 14, 14, 428
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=-1.0),
        SamplingParams(
            max_tokens=12,
            temperature=0,
            ignore_eos=True,
            frequency_penalty=-1.0,
            bad_words_token_ids=[[14, 14, 14]],
        ),
        # min_tokens bans the stop id 428 for the first 5 outputs only, drafted or not
        SamplingParams(
            max_tokens=12,
            temperature=0,
            ignore_eos=True,
            frequency_penalty=-1.0,
            min_tokens=5,
            stop_token_ids=[428],
        ),
    ]
    want = make_llm(model).generate(prompts, params, use_tqdm=False)
    llm = make_llm(model, speculative_config=SPEC)
    got = llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert got[0].outputs[0].stop_reason == free[9] and len(got[3].outputs[0].token_ids) == 3
    for i in (2, 4):  # row 4's output repeats a token from its 7th on: drafts get accepted
        assert (
            len(got[i].outputs[0].logprobs)
            == len(want[i].outputs[0].logprobs)
            == params[i].max_tokens
        )
        for a, b in zip(got[i].outputs[0].logprobs, want[i].outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert [x.logprob for x in a.values()] == pytest.approx(
                [x.logprob for x in b.values()], abs=1e-5
            )
            assert [x.rank for x in a.values()] == [x.rank for x in b.values()]
        assert got[i].outputs[0].cumulative_logprob == pytest.approx(
            want[i].outputs[0].cumulative_logprob, abs=1e-4
        )
    assert llm.llm_engine.get_stats().spec_decode.num_draft_tokens > 0  # the drafted path ran
    assert_no_block_leaks(llm)

    # Seeded sampling with drafts gives the same tokens again (the second run also hits the
    # prefix cache, so its steps differ).
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    first, again = (llm.generate(prompts, sampled, use_tqdm=False) for _ in range(2))
    for a, b in zip(first, again):
        assert (
            a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 12
        )
    assert_no_block_leaks(llm)


def test_speculation_with_async_scheduling_is_refused(llama):
    model = llama
    with pytest.raises(ValueError, match="does not work with async_scheduling"):
        LLMEngine.from_config(
            model,
            speculative_config=SPEC,
            async_scheduling=True,
            kv_cache_memory_bytes=8 << 20,
            warmup=False,
        )
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLMEngine.from_config(
            model,
            speculative_config={"num_speculative_tokens": 0},
            kv_cache_memory_bytes=8 << 20,
            warmup=False,
        )


def test_disable_by_batch_size_stops_drafting_for_large_batches(llama):
    """vLLM's ``disable_by_batch_size``: no drafts after a step of that many requests or more;
    drafting resumes once fewer run, and the outputs stay those without speculation."""
    model = llama
    loop = _prompts(0)[0]
    prompts = [loop[i:] for i in range(4)]
    lengths = (3, 5, 16, 16)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in lengths]
    llm = make_llm(model, speculative_config=dict(SPEC, disable_by_batch_size=3))
    runner = llm.llm_engine.runner
    seen = []  # (requests in the step, drafts proposed after it)
    collect = runner.collect

    def recording(handle):
        out = collect(handle)
        if handle is not None:
            seen.append((len(handle.states), sum(map(len, out.spec_token_ids))))
        return out

    runner.collect = recording
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [
        dense_greedy(model, p, m) for p, m in zip(prompts, lengths)
    ]
    assert all(d == 0 for n, d in seen if n >= 3) and any(d > 0 for n, d in seen if n < 3), seen
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        LLMEngine.from_config(
            model,
            speculative_config=dict(SPEC, disable_by_batch_size=0),
            kv_cache_memory_bytes=8 << 20,
            warmup=False,
        )
    assert_no_block_leaks(llm)


def test_warmup_compiles_the_verifiers(llama):
    """``warmup`` compiles a verify program per bucket of scored positions; drafted steps then
    run them with nothing compiled, and greedy tokens equal the dense forward's."""
    llm = make_llm(llama, speculative_config=SPEC, warmup=True, max_num_seqs=4)
    runner = llm.llm_engine.runner
    verifiers = [k for k in runner.programs.keys if k.kind == "verify"]
    assert (
        [k.size for k in verifiers] == list(runner.buckets.spec) == [1, 2, 4, 8, 16]
    )  # 4 rows x (k + 1)
    used = []
    real = runner._run
    runner._run = lambda kind, size, *args: (used.append((kind, size)), real(kind, size, *args))[1]
    outs = llm.generate(
        _prompts(0), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False
    )
    for p, o in zip(_prompts(0), outs):
        assert o.outputs[0].token_ids == dense_greedy(llama, p, 20)
    assert any(kind == "verify" for kind, _ in used) and runner.programs.late_compiles == []
