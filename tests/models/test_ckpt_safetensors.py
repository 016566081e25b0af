"""HF safetensors directories: written from a random model, loaded back by load_model."""

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_fixtures import hf_config_dict, small_config  # noqa: E402

from jaxkv.models import build_model, dense_forward, hf_state_dict  # noqa: E402
from jaxkv.models.checkpoint import read_safetensors_dir, write_safetensors_dir  # noqa: E402
from jaxkv.models.registry import load_model  # noqa: E402

IDS = jnp.asarray([[1, 5, 9, 200, 3, 77, 12, 8]], dtype=jnp.int32)  # [1, L]


@pytest.mark.parametrize(
    "name,dtype,shard_bytes",
    [
        ("tiny-llama", "float32", None),
        ("tiny-llama", "bfloat16", 40_000),  # bf16 tensors, several shards + index
        ("tiny-hybrid", "float32", 100_000),  # Gemma 2, sharded
    ],
)
def test_roundtrip_gives_identical_logits(tmp_path, name, dtype, shard_bytes):
    config = small_config(name, dtype=dtype)
    model = build_model(config, seed=3)
    tensors = hf_state_dict(model)
    write_safetensors_dir(tmp_path, hf_config_dict(config), tensors, max_shard_bytes=shard_bytes)
    if shard_bytes:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    if dtype == "bfloat16":
        _, back = read_safetensors_dir(tmp_path)
        assert str(back["model.embed_tokens.weight"].dtype) == "bfloat16"

    loaded, loaded_config, tokenizer = load_model(tmp_path, dtype=dtype, seed=99)
    assert tokenizer is None
    assert loaded_config == config
    np.testing.assert_array_equal(
        np.asarray(dense_forward(loaded, IDS)), np.asarray(dense_forward(model, IDS))
    )


def test_errors_name_the_problem(tmp_path):
    config = small_config()
    tensors = hf_state_dict(build_model(config))
    with pytest.raises(ValueError, match="no config.json"):
        read_safetensors_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(config)))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        read_safetensors_dir(tmp_path)

    sharded = write_safetensors_dir(
        tmp_path / "sharded", hf_config_dict(config), tensors, max_shard_bytes=50_000
    )
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="model-00002-of-.*missing"):
        read_safetensors_dir(sharded)

    partial = dict(tensors)
    del partial["model.layers.1.mlp.up_proj.weight"]
    write_safetensors_dir(tmp_path / "partial", hf_config_dict(config), partial)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path / "partial")
    with pytest.raises(ValueError, match="not a built-in model"):
        load_model(tmp_path / "does-not-exist")
