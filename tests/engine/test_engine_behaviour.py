"""Engine behaviour: compiles, seeded sampling, device block tables, logprobs, stop strings, bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.engine import LLMEngine
from jaxkv.models import dense_forward
from jaxkv.sampling_params import SamplingParams
from tests.engine import mixed_workload
from tests.engine.helpers import dense_greedy, make_llm, small_model


@pytest.fixture(scope="module")
def model():
    return small_model("tiny-llama")


@pytest.fixture(scope="module")
def llm(model):
    return make_llm(model)


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(3, 512, size=n).tolist()


def test_prefills_of_any_block_count_share_the_programs(model):
    """Block-table writes beyond one per row are applied by the table_ops program before the
    step, so prefills writing 10..16 entries run the warmed forwards (no compile), and their
    tokens match the dense forward."""
    llm = make_llm(
        model, max_num_seqs=8, max_num_batched_tokens=64, block_size=4, max_model_len=128
    )
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    runner.warmup(progress=False)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompts = [_prompt(20 + i, n) for i, n in enumerate([61, 57, 50, 63, 45, 38, 62, 55])]
    outs = llm.generate(prompts, params, use_tqdm=False)  # all at once: 8 rows, chunked
    for p in prompts:  # one at a time: 10..16 writes a step
        engine.add_request(engine.next_request_id(), p, params)
        while engine.has_unfinished_requests():
            engine.step()
    assert runner.programs.late_compiles == [] and runner.ops_layout.num_writes == 8
    assert [o.outputs[0].token_ids for o in outs] == [dense_greedy(model, p, 1) for p in prompts]


@pytest.mark.parametrize("backend", ["auto", "xla"])  # C++ zeroing where it builds; XLA scatter
def test_pages_beyond_the_step_capacity_are_zeroed_before_it(model, backend):
    """``_zero_now`` zeroes any number of pages, ``zero_chunk`` a call of the one program."""
    llm = make_llm(model, max_num_seqs=4, max_model_len=128, attention_backend=backend)
    runner = llm.llm_engine.runner
    runner.buffers = tuple(jnp.ones_like(b) for b in runner.buffers)
    ids = list(range(3, 3 + 2 * runner.zero_chunk + 5))
    runner._zero_now(ids)
    pages = np.asarray(runner.buffers[0]).reshape(-1, runner.page_bytes)
    assert (pages[ids] == 0).all() and (pages[:3] == 1).all() and (pages[ids[-1] + 1 :] == 1).all()
    assert runner.programs.num_compiles == 1


def test_bad_warmup_value_is_refused(model):
    with pytest.raises(ValueError, match="'prefill'"):
        make_llm(model, warmup="prefill")


def test_seeded_sampling_same_alone_and_in_batch(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    p = _prompt(7, 11)
    (alone,) = llm.generate([p], params, use_tqdm=False)
    others = [
        SamplingParams(max_tokens=9, temperature=0.7, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
    ]
    outs = llm.generate(
        [_prompt(8, 20), p, _prompt(9, 3)], [others[0], params, others[1]], use_tqdm=False
    )
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    # a different seed gives a different sequence (the test can fail)
    (other,) = llm.generate(
        [p],
        SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True),
        use_tqdm=False,
    )
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def test_device_block_tables_match_scheduler(model):
    """A long random run with preemption: after every step the device tables equal the
    block ids the scheduler's KV-cache manager holds for each running request."""
    llm = make_llm(model, num_gpu_blocks_override=14, max_num_seqs=6, max_num_batched_tokens=32)
    engine = llm.llm_engine
    rng = np.random.default_rng(5)
    next_id = 0
    for step in range(80):
        if rng.random() < 0.5 and engine.get_num_unfinished_requests() < 10:
            engine.add_request(
                f"q{next_id}",
                _prompt(100 + next_id, int(rng.integers(1, 60))),
                SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=0, ignore_eos=True),
            )
            next_id += 1
        if rng.random() < 0.05 and engine.get_num_unfinished_requests():
            engine.abort_request(next(iter(engine.output_processor._parents)))
        engine.step()
        runner = engine.runner
        tables = runner.device_block_tables()
        kv = engine.scheduler.kv_cache_manager
        running = {r.request_id for r in engine.scheduler.running}
        for req_id in runner.input_batch.req_ids:
            if req_id not in running:  # finished or preempted this step: the worker hears next step
                continue
            row = runner.row_of(req_id)
            for g, ids in enumerate(kv.get_block_ids(req_id)):
                assert tables[g][row, : len(ids)].tolist() == list(ids), (step, req_id, g)
                assert not tables[g][row, len(ids) :].any()
        for row in range(runner.input_batch.num_reqs, runner.max_num_seqs):
            assert all(not t[row].any() for t in tables)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().num_preemptions > 0
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_logprobs_and_prompt_logprobs_match_dense(llm, model):
    p = _prompt(11, 9)
    (out,) = llm.generate(
        [p],
        SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=1),
        use_tqdm=False,
    )
    c = out.outputs[0]
    full = p + c.token_ids
    logits = dense_forward(model, jnp.asarray([full]))[0]
    lsm = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for i, tok in enumerate(c.token_ids):
        pos = len(p) - 1 + i
        entry = c.logprobs[i]
        assert entry[tok].rank == 1
        np.testing.assert_allclose(entry[tok].logprob, lsm[pos, tok], atol=1e-4)
        top2 = np.argsort(-lsm[pos])[:2]
        assert set(top2.tolist()) <= set(entry)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for pos in range(1, len(p)):
        np.testing.assert_allclose(
            out.prompt_logprobs[pos][p[pos]].logprob, lsm[pos - 1, p[pos]], atol=1e-4
        )
    np.testing.assert_allclose(
        c.cumulative_logprob,
        sum(lsm[len(p) - 1 + i, t] for i, t in enumerate(c.token_ids)),
        atol=1e-3,
    )


def test_logprobs_modes_report_the_distribution_asked_for(model):
    """vLLM's logprobs_mode: "processed_logprobs" is the log-softmax of the logits a row samples
    from (penalties; then temperature and top-k, or temperature 1 for greedy rows; masked
    tokens -inf), "raw_logits" the model's logits: both against the dense forward along the
    generated tokens."""
    prompt = _prompt(11, 9)
    sampled = SamplingParams(
        max_tokens=4, temperature=0.7, top_k=3, seed=3, logprobs=4, ignore_eos=True
    )
    greedy = SamplingParams(
        max_tokens=4, temperature=0, repetition_penalty=1.3, logprobs=4, ignore_eos=True
    )
    fwd = jax.jit(lambda ids: dense_forward(model, ids))
    for mode in ("processed_logprobs", "raw_logits"):
        outs = make_llm(model, logprobs_mode=mode).generate(
            [prompt, prompt], [sampled, greedy], use_tqdm=False
        )
        for out, sp in zip(outs, (sampled, greedy)):
            tokens = prompt + out.outputs[0].token_ids
            ids = np.zeros((1, 64), np.int32)
            ids[0, : len(tokens)] = tokens
            logits = np.asarray(fwd(jnp.asarray(ids))[0], np.float64)
            for j, lp in enumerate(out.outputs[0].logprobs):
                row = logits[len(prompt) + j - 1].copy()
                if mode == "processed_logprobs":
                    if sp.repetition_penalty != 1:
                        seen = sorted(set(tokens[: len(prompt) + j]))
                        row[seen] = np.where(
                            row[seen] > 0,
                            row[seen] / sp.repetition_penalty,
                            row[seen] * sp.repetition_penalty,
                        )
                    if not sp.greedy:
                        row = row / sp.temperature
                        row = np.where(row < np.sort(row)[-sp.top_k], -np.inf, row)
                    finite = row[np.isfinite(row)]
                    row = row - (finite.max() + np.log(np.exp(finite - finite.max()).sum()))
                assert len(lp) >= 4
                for t, got in lp.items():
                    if np.isneginf(row[t]):
                        assert got.logprob == -np.inf, (mode, j, t)
                    else:
                        assert got.logprob == pytest.approx(row[t], abs=2e-4), (mode, j, t)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        make_llm(model, logprobs_mode="processed")


def test_allowed_token_ids_and_logit_bias_match_dense(llm, model):
    """Greedy with an allow-list follows the dense forward's argmax over the allowed tokens; a
    +100 bias wins every step; out-of-vocabulary ids are refused and the engine goes on."""
    p = _prompt(13, 9)
    allowed = [7, 42, 99, 300, 511]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, allowed_token_ids=allowed)
    biased = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={123: 100.0})
    out, bias_out = llm.generate([p, p], [params, biased], use_tqdm=False)
    fwd = jax.jit(lambda ids: dense_forward(model, ids))
    seq, want = list(p), []
    for _ in range(5):  # padded on the right to one length (causal): one compile
        logits = np.asarray(fwd(jnp.asarray([seq + [0] * (32 - len(seq))]))[0, len(seq) - 1])
        want.append(allowed[int(np.argmax(logits[allowed]))])
        seq.append(want[-1])
    assert out.outputs[0].token_ids == want and want != dense_greedy(model, p, 5)
    assert bias_out.outputs[0].token_ids == [123] * 3
    engine = llm.llm_engine
    with pytest.raises(
        ValueError, match=r"allowed_token_ids has token ids \[512\] outside the vocabulary"
    ):
        engine.add_request("bad", p, SamplingParams(allowed_token_ids=[1, 512]))
    with pytest.raises(ValueError, match=r"logit_bias has token ids \[600\]"):
        engine.add_request("bad", p, SamplingParams(logit_bias={600: 1.0}))
    with pytest.raises(ValueError, match="must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(TypeError, match="logit_bias must be a dict"):
        SamplingParams(logit_bias=[(1, 2.0)])
    with pytest.raises(ValueError, match="logit_bias needs"):
        SamplingParams(logit_bias={-1: 2.0})
    assert not engine.has_unfinished_requests()
    (again,) = llm.generate([p], params, use_tqdm=False)
    assert again.outputs[0].token_ids == want


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stop_strings(model, async_scheduling):
    llm = make_llm(
        model, tokenizer=mixed_workload.CharTokenizer(), async_scheduling=async_scheduling
    )
    (free,) = llm.generate(
        ["abcdefg"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )
    text = free.outputs[0].text
    stop = text[4:6]
    (stopped,) = llm.generate(
        ["abcdefg"], SamplingParams(max_tokens=12, temperature=0, stop=[stop]), use_tqdm=False
    )
    c = stopped.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]
    assert not llm.llm_engine.has_unfinished_requests()


class _AngleTokenizer:
    """Text "<i>" is token i; a leading space turns the first token into its mid-sentence
    spelling (i + 256) % 512 (as BPE vocabularies spell " word" apart from "word")."""

    eos_token_id = None
    bos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        ids = [int(t) for t in re.findall(r"<(\d+)>", text)]
        if text.startswith(" ") and ids:
            ids[0] = (ids[0] + 256) % 512
        return ids

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _vllm_bad_word_bans(words):
    """vLLM's rule, literally: ban a word's last token when the outputs end with the rest."""

    def banned(outputs):
        return [
            w[-1]
            for w in words
            if len(w) - 1 <= len(outputs)
            and (len(w) == 1 or outputs[len(outputs) - len(w) + 1 :] == w[:-1])
        ]

    return banned


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bad_words_match_dense_with_vllm_bans(model, async_scheduling):
    """Greedy with bad_words equals the dense forward's greedy loop with vLLM's bans applied
    (both spellings of each word); another request in the batch is unaffected."""
    p = _prompt(22, 7)  # the free run repeats no token
    free = dense_greedy(model, p, 8)
    two, one = free[2:4], free[6]  # a word the free run generates, and a single token
    words = [two, [(two[0] + 256) % 512, two[1]], [one], [(one + 256) % 512]]
    want = dense_greedy(model, p, 8, banned=_vllm_bad_word_bans(words))
    assert want[:3] == free[:3] and want != free
    llm = make_llm(model, tokenizer=_AngleTokenizer(), async_scheduling=async_scheduling)
    params = SamplingParams(
        max_tokens=8,
        temperature=0,
        ignore_eos=True,
        bad_words=["<{}><{}>".format(*two), f"<{one}>"],
    )
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out, other = llm.generate([p, p], [params, plain], use_tqdm=False)
    assert out.outputs[0].token_ids == want and other.outputs[0].token_ids == free
    assert params.bad_words_token_ids is None  # the caller's params are left alone
    with pytest.raises(ValueError, match=r"bad_words has token ids \[600\] outside the vocabulary"):
        llm.llm_engine.add_request("bad", p, SamplingParams(bad_words=["<600>"]))
    assert not llm.llm_engine.has_unfinished_requests()


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, model):
    p = _prompt(5, 30)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, truncate_prompt_tokens=6)
    long = [5] * 600 + p  # longer than max_model_len: -1 keeps the last 511
    (out, kept) = llm.generate(
        [p, long],
        [
            params,
            SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, truncate_prompt_tokens=-1),
        ],
        use_tqdm=False,
    )
    assert out.prompt_token_ids == p[-6:] and out.outputs[0].token_ids == dense_greedy(
        model, p[-6:], 4
    )
    assert kept.prompt_token_ids == long[-511:] and len(kept.outputs[0].token_ids) == 1


def test_reset_prefix_cache(llm):
    """Refused (False, nothing changed) while a request holds blocks; afterwards the same
    prompt finds no cached prefix."""
    engine = llm.llm_engine
    p = _prompt(6, 40)  # two full 16-token blocks
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([p], params, use_tqdm=False)
    engine.add_request("holds-blocks", p, params)
    engine.step()
    assert engine.scheduler.running and not llm.reset_prefix_cache()
    while engine.has_unfinished_requests():
        engine.step()
    (hit,) = llm.generate([p], params, use_tqdm=False)
    assert hit.num_cached_tokens == 32
    assert llm.reset_prefix_cache()
    (miss,) = llm.generate([p], params, use_tqdm=False)
    assert miss.num_cached_tokens == 0 and miss.outputs[0].token_ids == hit.outputs[0].token_ids


@pytest.mark.parametrize(
    "prompt, params, exc, match",
    [
        ([], None, ValueError, "empty"),
        (
            [1, 2, 99999],
            None,
            ValueError,
            r"the prompt has token ids \[99999\] outside the vocabulary",
        ),
        ([5] * 600, None, ValueError, "max_model_len"),
        ([1.5, 2], None, TypeError, "ints"),
        ("text", None, ValueError, "no tokenizer"),
        ([1, 2], "greedy", TypeError, "SamplingParams"),
        (
            [1, 2],
            SamplingParams(bad_words=["no"]),
            ValueError,
            r"bad_words \['no'\] need a tokenizer",
        ),
        (
            [1, 2],
            SamplingParams(bad_words_token_ids=[[3, 600]]),
            ValueError,
            r"bad_words has token ids \[600\]",
        ),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(llm, model, prompt, params, exc, match):
    engine = llm.llm_engine
    engine.add_request(
        "good", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    )
    with pytest.raises(exc, match=match):
        engine.add_request("bad", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["good"]
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_priority_and_cache_salt_types_and_numpy_prompt_ids(llm, model):
    engine = llm.llm_engine
    with pytest.raises(TypeError, match="priority must be an int, got 'high'"):
        engine.add_request("bad", [1, 2], priority="high")
    with pytest.raises(TypeError, match="cache_salt must be a str or None, got 5"):
        engine.add_request("bad", [1, 2], cache_salt=5)
    assert not engine.has_unfinished_requests()
    p = _prompt(3, 6)
    (out,) = llm.generate(
        [[np.int32(t) for t in p]],
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert out.prompt_token_ids == p and out.outputs[0].token_ids == dense_greedy(model, p, 3)


def test_generate_priority_orders_requests(model):
    """LLM.generate(priority=...) with the "priority" policy: one request at a time, lowest
    value first (as vLLM)."""
    llm = make_llm(model, scheduling_policy="priority", max_num_seqs=1)
    prompts = [_prompt(i, 5) for i in range(3)]
    outs = llm.generate(
        prompts,
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
        use_tqdm=False,
        priority=[2, 0, 1],
    )
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [1, 2, 0]
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        llm.generate(prompts, priority=[0, 1])


def test_invalid_sampling_params_and_ids(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    engine = llm.llm_engine
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    engine.abort_request(["dup", "nope"])  # unknown (or finished) ids are ignored, as in vLLM
    assert not engine.has_unfinished_requests()
    engine.abort_request("dup")  # twice: already gone
    with pytest.raises(TypeError, match="must be str"):
        engine.abort_request([3])


def test_parallel_sizes_refused_clearly(model):
    """Tensor parallelism itself is tested on 2 host devices (tests/engine/test_tensor_parallel.py)."""
    make_llm(model, tensor_parallel_size=1, pipeline_parallel_size=1)  # vLLM scripts pass these
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        make_llm(model, pipeline_parallel_size=2)
    for bad in (0, True, 1.0):
        with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
            make_llm(model, tensor_parallel_size=bad)
    n = jax.device_count() + 1
    with pytest.raises(ValueError, match=f"tensor_parallel_size={n} needs {n} devices"):
        make_llm(model, tensor_parallel_size=n)


def test_kv_budget_too_small(model):
    with pytest.raises(ValueError, match="largest max_model_len that fits"):
        LLMEngine.from_config(
            model,
            kv_cache_memory_bytes=64 << 10,
            max_model_len=512,
            max_num_seqs=4,
            max_num_batched_tokens=64,
        )


def test_output_kinds(model):
    """CUMULATIVE outputs hold everything so far, DELTA only what is new (concatenating to the
    same result), FINAL_ONLY one output at the end; LLM.generate leaves the caller's params alone."""
    from jaxkv import RequestOutputKind

    llm = make_llm(model, tokenizer=mixed_workload.CharTokenizer())
    engine = llm.llm_engine
    base = dict(max_tokens=7, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    for kind in RequestOutputKind:
        engine.add_request(kind.name, "abcdef", SamplingParams(**base, output_kind=kind))
    seen = {k.name: [] for k in RequestOutputKind}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    final = seen["CUMULATIVE"][-1]
    assert [len(o.outputs[0].token_ids) for o in seen["CUMULATIVE"]] == list(range(1, 8))
    (only,) = seen["FINAL_ONLY"]
    assert only.finished and only.outputs[0].token_ids == final.outputs[0].token_ids
    delta = seen["DELTA"]
    assert [len(o.outputs[0].token_ids) for o in delta] == [1] * 7 and delta[-1].finished
    assert sum((o.outputs[0].token_ids for o in delta), []) == final.outputs[0].token_ids
    assert (
        "".join(o.outputs[0].text for o in delta) == final.outputs[0].text
        and len(final.outputs[0].text) == 7
    )
    assert sum((o.outputs[0].logprobs for o in delta), []) == final.outputs[0].logprobs
    assert delta[0].prompt_logprobs == final.prompt_logprobs and delta[1].prompt_logprobs is None

    # A prompt longer than the 64-token budget: its prompt logprobs come in two chunks, and
    # the DELTA pieces concatenate to the cumulative list without repeats.
    prompt = "abcdefghij" * 10
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        engine.add_request(
            f"long-{kind.name}",
            prompt,
            SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, output_kind=kind),
        )
    pieces = {k.name: [] for k in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces[out.request_id.split("-")[1]].append(out.prompt_logprobs)
    cumulative = pieces["CUMULATIVE"][-1]
    joined = sum((p for p in pieces["DELTA"] if p is not None), [])
    assert len(cumulative) == len(joined) == 100 and len([p for p in pieces["DELTA"] if p]) >= 2
    for a, b in zip(joined, cumulative):  # two requests of one batch: float rounding may differ
        assert (a is None) == (b is None)
        if a is not None:
            assert {t: x.rank for t, x in a.items()} == {t: x.rank for t, x in b.items()}
            assert [x.logprob for x in a.values()] == pytest.approx(
                [x.logprob for x in b.values()], abs=1e-5
            )

    # n > 1: a streamed output holds only the completions with something new (vLLM V1), a
    # finished completion is reported once; per index the DELTA pieces make up the final
    # output, and the last CUMULATIVE completion of each index is it.
    sampled = dict(
        n=3, max_tokens=10, temperature=1.0, seed=11, stop=["a", "e", "i"], ignore_eos=True
    )
    for name, kind in (("delta", "DELTA"), ("final", "FINAL_ONLY"), ("cumulative", "CUMULATIVE")):
        engine.add_request(
            f"n3-{name}", "abcdef", SamplingParams(**sampled, output_kind=RequestOutputKind[kind])
        )
    got = {"n3-delta": [], "n3-final": [], "n3-cumulative": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].append(out)
    (final,) = got["n3-final"]
    ends = sorted(len(c.token_ids) for c in final.outputs)
    assert ends[0] < ends[-1], ends  # the children stop at different steps
    done, joined = set(), {i: [] for i in range(3)}
    for out in got["n3-delta"]:
        indices = [c.index for c in out.outputs]
        assert len(indices) == len(set(indices)) and not done & set(indices)
        for c in out.outputs:
            assert c.token_ids or c.finish_reason is not None
            joined[c.index] += c.token_ids
            if c.finish_reason is not None:
                done.add(c.index)
    assert done == {0, 1, 2} and any(len(o.outputs) < 3 for o in got["n3-delta"])
    assert {c.index: c.token_ids for c in final.outputs} == joined
    latest, done = {}, set()
    for out in got["n3-cumulative"]:
        for c in out.outputs:
            prev = latest.get(c.index, [])
            assert c.index not in done and c.token_ids[: len(prev)] == prev
            assert len(c.token_ids) > len(prev) or c.finish_reason is not None  # something new
            latest[c.index] = c.token_ids
            if c.finish_reason is not None:
                done.add(c.index)
    assert latest == joined and any(len(o.outputs) < 3 for o in got["n3-cumulative"])

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    (out,) = llm.generate(["abc"], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2 and params.output_kind == RequestOutputKind.CUMULATIVE
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind, got 5"):
        SamplingParams(output_kind=5)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams, got str"):
        llm.generate(["abc"], "greedy", use_tqdm=False)
    assert not engine.has_unfinished_requests()
