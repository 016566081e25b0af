"""Loading onto a two-device mesh: every parameter created shard by shard, equal to the
one-device load.

Not collected by a plain ``pytest`` run (the name does not start with ``test_``):
``test_load_sharded.py`` runs it in a subprocess with two CPU host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``). On a machine with two or more
accelerators it runs as is: ``pytest tests/models/load_sharded_cases.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_fixtures import hf_config_dict, small_config, write_llama_gguf
from no_random_init import forbid_concrete_random_init

from jaxkv.models import build_model, hf_state_dict
from jaxkv.models.checkpoint import restore_params, save_params, write_safetensors_dir
from jaxkv.models.checkpoint.safetensors_dir import SafetensorsTensors
from jaxkv.models.registry import load_model
from jaxkv.models.sharding import make_tp_mesh, param_name, shard_state

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")


def _params(model) -> dict:
    return {
        param_name(p): x
        for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }


def _assert_bitwise_equal(a, b):
    pa, pb = _params(a), _params(b)
    assert sorted(pa) == sorted(pb)
    for name in pa:
        x, y = np.asarray(pa[name]), np.asarray(pb[name])
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), name


def _shard_shapes(model) -> dict:
    """name -> (global shape, [shape of each device's shard])."""
    out = {}
    for name, x in _params(model).items():
        shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
        assert len(shards) == 2 and len({s.device for s in shards}) == 2, name
        out[name] = (x.shape, [s.data.shape for s in shards])
    return out


def _assert_split_like_small_llama(model):
    """small_config's tiny-llama: hidden 64, 4 heads of 16, 2 KV heads, MLP 128, vocab 288."""
    shards = _shard_shapes(model)
    assert shards["model.layers.0.self_attn.q_proj.kernel"] == ((64, 64), [(64, 32)] * 2)
    assert shards["model.layers.1.self_attn.k_proj.kernel"] == ((64, 32), [(64, 16)] * 2)
    assert shards["model.layers.0.self_attn.o_proj.kernel"] == ((64, 64), [(32, 64)] * 2)
    assert shards["model.layers.1.mlp.down_proj.kernel"] == ((128, 64), [(64, 64)] * 2)
    assert shards["model.embed_tokens.embedding"] == ((288, 64), [(144, 64)] * 2)
    assert shards["lm_head.weight"] == ((288, 64), [(144, 64)] * 2)
    assert shards["model.norm.weight"] == ((64,), [(64,)] * 2)  # replicated
    w = _params(model)["model.layers.0.mlp.up_proj.kernel"]  # the two halves differ
    a, b = sorted(w.addressable_shards, key=lambda s: s.device.id)
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(w)[:, :64])
    np.testing.assert_array_equal(np.asarray(b.data), np.asarray(w)[:, 64:])


@pytest.mark.parametrize("dtype, shard_bytes", [("float32", None), ("bfloat16", 40_000)])
def test_safetensors_shard_by_shard(tmp_path, monkeypatch, dtype, shard_bytes):
    """Same parameters as the one-device load; each device holds only its shard; a split
    parameter is read as slices of the file's tensor, never whole; no random init."""
    config = small_config("tiny-llama", dtype=dtype)
    write_safetensors_dir(
        tmp_path,
        hf_config_dict(config),
        hf_state_dict(build_model(config, seed=3)),
        max_shard_bytes=shard_bytes,
    )
    one, one_config, _ = load_model(tmp_path, dtype=dtype)
    reads = []
    real_read = SafetensorsTensors.read
    monkeypatch.setattr(
        SafetensorsTensors,
        "read",
        lambda self, name, index=None: reads.append((name, index)) or real_read(self, name, index),
    )
    mesh = make_tp_mesh(2)
    with forbid_concrete_random_init(monkeypatch):
        two, two_config, _ = load_model(tmp_path, dtype=dtype, mesh=mesh)
    assert two_config == one_config == config
    _assert_bitwise_equal(one, two)
    _assert_split_like_small_llama(two)
    q = [index for name, index in reads if name == "model.layers.0.self_attn.q_proj.weight"]
    assert len(q) == 2 and all(index is not None for index in q)  # HF [out, in]: split rows
    assert sorted((i[0].start or 0, i[0].stop) for i in q) == [(0, 32), (32, 64)], q


def test_gguf_on_a_mesh(tmp_path, monkeypatch):
    """A GGUF (one tensor Q8_0) loads onto the mesh with the one-device parameters."""
    config = small_config("tiny-llama")
    tensors = hf_state_dict(build_model(config, seed=4))
    write_llama_gguf(
        tmp_path / "m.gguf",
        hf_config_dict(config),
        tensors,
        quantize={"model.layers.1.mlp.up_proj.weight": gguf.GGMLQuantizationType.Q8_0},
    )
    one, _, tok1 = load_model(tmp_path / "m.gguf")
    with forbid_concrete_random_init(monkeypatch):
        two, _, tok2 = load_model(tmp_path / "m.gguf", mesh=make_tp_mesh(2))
    _assert_bitwise_equal(one, two)
    _assert_split_like_small_llama(two)
    assert tok1.encode("hello world") == tok2.encode("hello world")


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-hybrid"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_init_sharded_is_bitwise_the_same(family, dtype):
    """The jitted, sharded init gives the eager init's values bit for bit (threefry
    partitionable, scaling kept out of the sampler's fusion), each device its own shard."""
    assert jax.config.jax_threefry_partitionable  # the default since jax 0.5: nothing set
    config = small_config(family, dtype=dtype)
    one = build_model(config, seed=11)
    two = build_model(config, seed=11, mesh=make_tp_mesh(2))
    _assert_bitwise_equal(one, two)
    if family == "tiny-llama":
        _assert_split_like_small_llama(two)


def test_builtin_name_on_a_mesh():
    model, config, _ = load_model("tiny-hybrid", mesh=make_tp_mesh(2), seed=2)
    x = _params(model)["model.layers.0.mlp.gate_proj.kernel"]
    assert x.shape == (config.hidden_size, config.intermediate_size)
    assert [s.data.shape for s in x.addressable_shards] == [
        (config.hidden_size, config.intermediate_size // 2)
    ] * 2
    ref = build_model(config, seed=2)
    np.testing.assert_array_equal(
        np.asarray(x), np.asarray(_params(ref)["model.layers.0.mlp.gate_proj.kernel"])
    )


def test_shard_state_keeps_placed_arrays(tmp_path):
    """ModelRunner still calls shard_state: arrays already placed are not moved or copied."""
    config = small_config("tiny-llama")
    write_safetensors_dir(
        tmp_path, hf_config_dict(config), hf_state_dict(build_model(config, seed=3))
    )
    mesh = make_tp_mesh(2)
    model, _, _ = load_model(tmp_path, mesh=mesh)
    state = nnx.state(model)
    again = shard_state(state, mesh)
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(again)):
        assert a is b


def test_orbax_restore_on_a_mesh(tmp_path):
    config = small_config("tiny-hybrid")
    model = build_model(config, seed=5)
    save_params(model, tmp_path / "ckpt")
    two = restore_params(config, tmp_path / "ckpt", mesh=make_tp_mesh(2))
    _assert_bitwise_equal(model, two)
    shards = _shard_shapes(two)
    assert shards["model.layers.0.self_attn.q_proj.kernel"] == ((64, 64), [(64, 32)] * 2)


def test_splits_that_do_not_divide_are_refused(tmp_path):
    config = small_config("tiny-llama", intermediate_size=96 + 1)
    write_safetensors_dir(
        tmp_path, hf_config_dict(config), hf_state_dict(build_model(config, seed=3))
    )
    with pytest.raises(
        ValueError,
        match=r"does not divide axis 0 of model\.layers\.0\.mlp\.down_proj\.kernel \[97, 64\]",
    ):
        load_model(tmp_path, mesh=make_tp_mesh(2))
    with pytest.raises(
        ValueError,
        match=r"does not divide axis 0 of model\.layers\.0\.mlp\.down_proj\.kernel \[97, 64\]",
    ):
        build_model(config, mesh=make_tp_mesh(2))
    odd_vocab = small_config("tiny-llama", vocab_size=287)  # IF_DIVISIBLE: replicated
    model = build_model(odd_vocab, mesh=make_tp_mesh(2))
    assert [s.data.shape for s in _params(model)["lm_head.weight"].addressable_shards] == [
        (287, 64)
    ] * 2
