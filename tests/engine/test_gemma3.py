"""Gemma 3's layer pattern through the engine: five sliding-window layers to one global, each
kind in its own KV-cache groups; paged greedy tokens equal the dense forward's."""

import numpy as np

from jaxkv.sampling_params import SamplingParams
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, gemma3_model, make_llm
from tests.two_host_devices import run_cases_on_two_host_devices

WINDOW = 16


def _model(seed=0):
    return gemma3_model(num_kv_heads=1, window=WINDOW, seed=seed)


def test_gemma3_paged_equals_dense_and_sliding_layers_hold_the_window():
    model = _model()
    llm = make_llm(
        model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, block_size=4
    )
    groups = llm.llm_engine.kv_cache_config.kv_cache_groups
    windows = sorted({g.kv_cache_spec.sliding_window for g in groups}, key=lambda w: w or 0)
    assert windows == [None, WINDOW], groups  # full and sliding layers in groups of their own
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(3, 256, size=n).tolist() for n in (150, 40, 7)
    ]  # longer than the window
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == dense_greedy(model, p, 12), len(p)
    assert_no_block_leaks(llm)


def test_gemma3_sliding_groups_hold_only_the_window():
    """A 200-token request: a full-attention group holds every block of it, a sliding group
    only the window's (plus the block being written) from its first decode on."""
    model = _model()
    llm = make_llm(
        model, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=256, block_size=4
    )
    engine = llm.llm_engine
    engine.add_request(
        "long", list(range(3, 203)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    engine.step()  # the prefill
    engine.step()  # a decode: blocks no query can see any more are freed before it (as vLLM)
    groups = engine.kv_cache_config.kv_cache_groups
    ids = engine.scheduler.kv_cache_manager.get_block_ids("long")
    held = {}
    for g, blocks in zip(groups, ids):  # freed blocks of a sliding group read as the null block 0
        held.setdefault(g.kv_cache_spec.sliding_window, set()).add(sum(b != 0 for b in blocks))
    assert held[None] == {-(-201 // 4)}, held  # the prompt and the token being decoded
    assert max(held[WINDOW]) <= WINDOW // 4 + 2, held
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_block_leaks(llm)


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _assert_matches_dense(model, prompts, outs, max_tokens=12):
    for p, o in zip(prompts, outs):
        assert o.finished
        assert o.outputs[0].token_ids == dense_greedy(model, p, max_tokens), (len(p), p[:4])


def test_gemma3_chunked_prefill_and_prefix_hits_past_the_window():
    """A 90-token prompt in a 32-token budget (chunks after the first start past the window),
    then a 40-token shared prefix (ten blocks, longer than the 16-token window): the later
    requests resume from the cache at token 40 (full group: every block; sliding groups: the
    window's blocks, null blocks before). The pool (96 blocks; the 90-token request may need
    92) is small enough that freed blocks are handed out again during the long prefill, so a
    block freed while a later query of its chunk still reads it would be overwritten (tokens
    unlike the dense forward's), but nothing is preempted."""
    model = _model()
    llm = make_llm(
        model,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=256,
        block_size=4,
        num_gpu_blocks_override=96,
    )
    engine = llm.llm_engine
    rng = np.random.default_rng(1)
    long = [rng.integers(3, 256, size=90).tolist()]
    shared = rng.integers(3, 256, size=40).tolist()
    first = [shared + rng.integers(3, 256, size=5).tolist()]
    later = [shared + rng.integers(3, 256, size=n).tolist() for n in (3, 9)]
    outs = llm.generate(long, GREEDY, use_tqdm=False) + llm.generate(first, GREEDY, use_tqdm=False)
    assert engine.get_stats().prefix_hit_tokens == 0
    outs += llm.generate(later, GREEDY, use_tqdm=False)
    # Block size 4: the prefix's ten blocks are all hit (a sliding group needs only the last
    # cdiv(WINDOW - 1, 4) = 4 of them), so each later request starts at token 40.
    assert [o.num_cached_tokens for o in outs[2:]] == [40, 40], [o.num_cached_tokens for o in outs]
    stats = engine.get_stats()
    assert stats.prefix_hit_tokens == 80 and stats.num_preemptions == 0, stats
    _assert_matches_dense(model, long + first + later, outs)
    assert_no_block_leaks(llm)


def test_gemma3_preemption_small_pool():
    """A pool too small for four requests at once (each holds its full-attention blocks plus
    five sliding groups' window blocks): requests are preempted and recomputed (under a
    32-token budget, so in chunks), and greedy tokens still equal the dense forward's."""
    model = _model()
    llm = make_llm(
        model,
        num_gpu_blocks_override=120,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=256,
        block_size=4,
    )
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (40, 45, 50, 35)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0, llm.llm_engine.get_stats()
    _assert_matches_dense(model, prompts, outs, max_tokens=16)
    assert_no_block_leaks(llm)


def test_gemma3_long_generation_sliding_blocks_stay_bounded():
    """120 tokens after a 20-token prompt (block size 4), one step at a time: after every step
    each sliding group holds the blocks of the last window (no fewer: the next query reads
    them) and at most WINDOW // 4 + 2 real blocks, the full group one block per 4 computed
    tokens, and the pool's used blocks are exactly those held; tokens equal the dense forward's."""
    model = _model()
    llm = make_llm(
        model, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256, block_size=4
    )
    engine = llm.llm_engine
    manager = engine.scheduler.kv_cache_manager
    pool = manager.block_pool
    windows = [g.kv_cache_spec.sliding_window for g in engine.kv_cache_config.kv_cache_groups]
    assert windows.count(WINDOW) == 5 and windows.count(None) == 1, windows
    prompt = np.random.default_rng(3).integers(3, 256, size=20).tolist()
    engine.add_request(
        "long", prompt, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    )
    tokens, steps, full_sizes = None, 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        steps += 1
        if not engine.has_unfinished_requests():
            break
        computed = engine.scheduler.requests["long"].num_computed_tokens
        assert computed == len(prompt) + steps - 1, (steps, computed)  # the prompt, then one a step
        ids = manager.get_block_ids("long")
        held = 0
        for window, blocks in zip(windows, ids):
            real = [i for i, b in enumerate(blocks) if b != 0]
            held += len(real)
            if window is None:
                assert real == list(range(-(-computed // 4))), (steps, computed, blocks)
                full_sizes.append(len(real))
            else:  # the last query (position computed - 1) read computed - WINDOW .. computed - 1
                need = set(range(max(computed - WINDOW, 0) // 4, (computed - 1) // 4 + 1))
                assert need <= set(real), (steps, computed, blocks)
                assert len(real) <= WINDOW // 4 + 2, (steps, computed, blocks)
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 - held, (steps, held)
    assert steps == 120
    assert full_sizes == [-(-(19 + s) // 4) for s in range(1, 120)], full_sizes  # 5 .. 35 blocks
    assert tokens == dense_greedy(model, prompt, 120)
    assert_no_block_leaks(llm)


def test_gemma3_tensor_parallel_on_two_host_devices():
    """Runs tests/engine/tp_gemma3_cases.py on two CPU devices (jax fixes its device count when
    it starts, so in a fresh interpreter, as test_tensor_parallel.py runs tp_cases.py): Gemma 3
    with two KV heads split over the devices gives the dense forward's greedy tokens. Every
    case must pass, none skip."""
    run_cases_on_two_host_devices("tests/engine/tp_gemma3_cases.py")
