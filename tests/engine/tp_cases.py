"""Tensor parallelism on two devices, against the dense forward and the one-device engine.

Not collected by a plain ``pytest`` run (the file name does not start with ``test_``):
``test_tensor_parallel.py`` runs it in a subprocess with two CPU host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``, set before jax starts). On a machine
with two or more accelerators it runs as is: ``pytest tests/engine/tp_cases.py``.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.models import dense_forward
from jaxkv.models.dense_reference import dense_hidden
from jaxkv.models.sharding import param_name
from jaxkv.pooling_params import PoolingParams
from jaxkv.sampling_params import SamplingParams
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, make_llm, small_model

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prompts(rng, lengths):
    return [rng.integers(3, 512, size=n).tolist() for n in lengths]


def _collectives(runner) -> dict:
    """Per program the runner has compiled: its HLO's collectives, by (op, f32 operand dims)."""
    found = {}
    for key in runner.programs.keys:
        text = runner.programs.get(key).as_text()
        ops = collections.Counter()
        for dims, op in re.findall(
            r"= \w+\[([\d,]*)\]\S* (all-reduce|all-gather|all-to-all|"
            r"reduce-scatter|collective-permute)\(",
            text,
        ):
            ops[op, tuple(int(d) for d in dims.split(",") if d)] += 1
        found[key] = ops
    return found


def test_matches_dense_with_chunks_prefix_hits_and_preemption():
    """Greedy tokens equal the dense forward's under chunked prefill (a 90-token prompt in a
    64-token budget), prefix-cache hits and preemption (a pool of 12 blocks); no block leaks."""
    model = small_model("tiny-llama")
    llm = make_llm(model, tensor_parallel_size=2, num_gpu_blocks_override=12, max_num_seqs=4)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 512, size=40).tolist()
    first = [shared + rng.integers(3, 512, size=5).tolist(), rng.integers(3, 512, size=90).tolist()]
    later = [shared + t for t in _prompts(rng, [7, 3, 12])] + _prompts(rng, [30])
    outs = llm.generate(first, GREEDY, use_tqdm=False)
    outs += llm.generate(
        later, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    for p, o in zip(first + later, outs):
        assert o.outputs[0].token_ids == dense_greedy(model, p, len(o.outputs[0].token_ids)), p[:4]
    assert any(o.num_cached_tokens >= 32 for o in outs[2:5]), [o.num_cached_tokens for o in outs]
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert_no_block_leaks(llm)


def test_weights_and_kv_heads_are_split():
    """Each device holds half of every split weight (embedding and LM head by vocabulary) and
    of the KV heads' pages, the per-device KV budget gives twice the blocks of one device, and
    the forward communicates by one all-reduce after o_proj and one after down_proj per layer
    and one for the embedding lookup, the greedy sampler by one all-gather of the logits, and
    nothing else (a step that pools hidden states too; the small update programs none). (The XLA
    attention backend here; the other tests use the default, the C++ kernels.)"""
    model = small_model("tiny-llama")
    one = make_llm(model, attention_backend="xla")
    two = make_llm(model, tensor_parallel_size=2, attention_backend="xla")
    (out,) = two.generate([list(range(3, 40))], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == dense_greedy(model, list(range(3, 40)), 8)
    # Pooling under TP: the hidden states are whole on every device, and need no collective.
    (emb,) = two.encode(
        [list(range(3, 30))],
        PoolingParams(normalize=False),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    ref = dense_hidden(model, jnp.asarray([list(range(3, 30))], jnp.int32))[0]
    np.testing.assert_allclose(emb.outputs.data, np.asarray(ref), atol=2e-5)
    runner = two.llm_engine.runner
    shards = {
        param_name(p): (x.shape, x.addressable_shards[0].data.shape)
        for p, x in jax.tree_util.tree_leaves_with_path(runner.state)
    }
    assert shards["model.layers.0.self_attn.q_proj.kernel"] == ((128, 128), (128, 64))
    assert shards["model.layers.1.mlp.down_proj.kernel"] == ((256, 128), (128, 128))
    assert shards["lm_head.weight"] == ((512, 128), (256, 128))
    assert shards["model.embed_tokens.embedding"] == ((512, 128), (256, 128))
    assert shards["model.norm.weight"] == ((128,), (128,))  # replicated
    c1, c2 = one.llm_engine.kv_cache_config, two.llm_engine.kv_cache_config
    assert c2.num_blocks == 2 * c1.num_blocks
    buf1, buf2 = one.llm_engine.runner.buffers[0], runner.buffers[0]
    assert buf2.shape[0] == 2 * buf1.shape[0]
    assert buf2.addressable_shards[0].data.shape == buf1.shape  # same bytes per device
    assert len({s.device for s in buf2.addressable_shards}) == 2
    found = _collectives(runner)
    assert {k.kind for k in found} >= {"forward", "greedy"}, found
    for key, ops in found.items():  # logits vocab-major (greedy): [V, S]
        if key.kind == "forward":
            want = {("all-reduce", (key.size, 128)): 2 * 2 + 1}
            if key.size <= runner.max_num_seqs:  # the forward's own greedy head
                want["all-gather", (512, key.size)] = 1
            assert ops == want, (key, ops)
        elif key.kind == "greedy":
            assert ops == {("all-gather", (512, key.size)): 1}, (key, ops)
        else:
            assert not ops, (key, ops)


def test_pallas_kernels_per_device():
    """The Pallas kernels (what runs on GPU / TPU; interpret mode here) under ``shard_map``."""
    model = small_model("tiny-llama")
    llm = make_llm(model, tensor_parallel_size=2, attention_backend="pallas")
    prompt = list(range(3, 23))
    (out,) = llm.generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert out.outputs[0].token_ids == dense_greedy(model, prompt, 3)


def test_sampling_and_logprobs_match_one_device():
    """Seeded sampling draws the same tokens as on one device; sampled-token and prompt
    logprobs agree with the dense forward's log-softmax."""
    model = small_model("tiny-llama")
    rng = np.random.default_rng(3)
    prompts = _prompts(rng, [9, 33])
    params = SamplingParams(
        max_tokens=6,
        temperature=0.8,
        top_k=50,
        seed=7,
        logprobs=2,
        prompt_logprobs=1,
        ignore_eos=True,
    )
    ref = make_llm(model).generate(prompts, params, use_tqdm=False)
    outs = make_llm(model, tensor_parallel_size=2).generate(prompts, params, use_tqdm=False)
    for p, r, o in zip(prompts, ref, outs):
        toks = o.outputs[0].token_ids
        assert toks == r.outputs[0].token_ids
        lsm = np.asarray(jax.nn.log_softmax(dense_forward(model, jnp.asarray([p + toks]))[0], -1))
        for i, t in enumerate(toks):
            np.testing.assert_allclose(
                o.outputs[0].logprobs[i][t].logprob, lsm[len(p) - 1 + i, t], atol=1e-4
            )
        for pos in range(1, len(p)):
            np.testing.assert_allclose(
                o.prompt_logprobs[pos][p[pos]].logprob, lsm[pos - 1, p[pos]], atol=1e-4
            )


@pytest.mark.parametrize(
    "family, extra",
    [
        ("tiny-hybrid", dict(async_scheduling=True)),
        (
            "tiny-llama",
            dict(
                speculative_config={
                    "method": "ngram",
                    "num_speculative_tokens": 3,
                    "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1,
                }
            ),
        ),
    ],
)
def test_async_and_speculative_steps(family, extra):
    """Async scheduling on the hybrid model (sliding-window layers, soft-caps, tied embedding)
    and n-gram drafts (repetitive prompts, so drafts are accepted) give the dense forward's
    greedy tokens."""
    model = small_model(family)
    llm = make_llm(model, tensor_parallel_size=2, **extra)
    rng = np.random.default_rng(5)
    loop = rng.integers(3, 512, size=6).tolist()
    prompts = [loop * 4, loop[:3] * 5 + [7]]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == dense_greedy(model, p, 20)
    if "speculative_config" in extra:
        st = llm.llm_engine.get_stats()
        assert 0 < st.spec_decode.num_accepted_tokens < st.spec_decode.num_draft_tokens, st
    assert_no_block_leaks(llm)


def test_model_rules_and_bad_sizes():
    """A model's own ``tp_partition_rules`` (here: none, so weights are replicated) still
    gives exact results; head counts or weight axes that do not divide are refused, except a
    vocabulary, which then stays whole."""
    model = small_model("tiny-llama")
    model.tp_partition_rules = ()
    llm = make_llm(model, tensor_parallel_size=2)
    (out,) = llm.generate([list(range(5, 30))], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == dense_greedy(model, list(range(5, 30)), 8)
    w = jax.tree_util.tree_leaves(llm.llm_engine.runner.state)[0]
    assert w.addressable_shards[0].data.shape == w.shape
    odd = make_llm(
        small_model("tiny-llama", vocab_size=511), tensor_parallel_size=2
    ).llm_engine.runner.state
    assert odd["lm_head"]["weight"][...].addressable_shards[0].data.shape == (511, 128)
    assert odd["model"]["layers"][0]["mlp"]["up_proj"]["kernel"][...].addressable_shards[
        0
    ].data.shape == (128, 128)
    with pytest.raises(ValueError, match="does not divide the 1 KV heads"):
        make_llm(small_model("tiny-llama", num_key_value_heads=1), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="does not divide num_attention_heads=3"):
        make_llm(
            small_model("tiny-llama", num_attention_heads=3, num_key_value_heads=1),
            tensor_parallel_size=2,
        )
    with pytest.raises(ValueError, match=r"axis 0 of model\.layers\.0\.mlp\.down_proj\.kernel"):
        make_llm(small_model("tiny-llama", intermediate_size=255), tensor_parallel_size=2)


def test_named_model_loads_onto_the_mesh_and_measures_its_devices(tmp_path, monkeypatch):
    """A model named by path (``LLM(path, tensor_parallel_size=2)``): the worker creates
    every parameter already split (its model's arrays carry the TP shardings before any
    runner places them), greedy tokens equal the dense forward, and with devices that
    report a limit (faked) each rank reports limit x util - its own shards' weights - the
    sampling state (replicated) - the largest program's temp (faked: 1 MiB; the profile on a
    mesh is memory_profile_cases.py's), over its smallest device."""
    from flax import nnx

    from jaxkv.models import hf_state_dict
    from jaxkv.models.checkpoint import write_safetensors_dir
    from jaxkv.models.sharding import state_shardings
    from jaxkv.worker import worker as worker_module
    from tests.models.ckpt_fixtures import hf_config_dict
    from tests.worker.test_worker_memory import FakeDevice

    model = small_model("tiny-llama", seed=4)
    write_safetensors_dir(tmp_path, hf_config_dict(model.config), hf_state_dict(model))
    real_init, meshes = worker_module.Worker.init_device, []

    def init_device(self):
        real_init(self)
        assert len(self.devices) == 2
        self.devices = [FakeDevice(64 << 20), FakeDevice(32 << 20)]

    def temp(m, specs, **kwargs):
        meshes.append(kwargs["mesh"])
        return 1 << 20

    monkeypatch.setattr(worker_module.Worker, "init_device", init_device)
    monkeypatch.setattr(worker_module, "largest_step_temp_bytes", temp)
    llm = make_llm(
        str(tmp_path),
        tensor_parallel_size=2,
        kv_cache_memory_bytes=None,
        gpu_memory_utilization=0.5,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
    )
    worker = llm.llm_engine.engine_core.model_executor.driver_worker.worker
    state = nnx.state(worker.model)
    want = state_shardings(state, worker.mesh)
    for (path, x), s in zip(
        jax.tree_util.tree_leaves_with_path(state), jax.tree_util.tree_leaves(want)
    ):
        assert x.sharding.is_equivalent_to(s, x.ndim), param_name(path)
    per_device = collections.Counter()
    for x in jax.tree_util.tree_leaves(state):
        for shard in x.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    assert len(per_device) == 2
    per_device = max(per_device.values())
    assert per_device < 0.6 * sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    assert meshes == [worker.mesh]
    config = llm.llm_engine.kv_cache_config
    page = config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    sampling = sum(x.nbytes for x in jax.tree_util.tree_leaves(worker.model_runner.sampling_state))
    assert config.num_blocks == ((15 << 20) - per_device - sampling) // page // len(
        config.kv_cache_tensors
    )
    prompt = list(range(3, 30))
    (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == dense_greedy(model, prompt, 8)
