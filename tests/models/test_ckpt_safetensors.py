"""HF safetensors directories: written from a random model, loaded back by load_model."""

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_fixtures import hf_config_dict, small_config

from jaxkv.models import build_model, dense_forward, hf_state_dict
from jaxkv.models.checkpoint import read_safetensors_dir, write_safetensors_dir
from jaxkv.models.registry import load_model

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


@pytest.mark.parametrize("layout", ["model.language_model.", "language_model.model."])
def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path, layout):
    """A Gemma 3 multimodal checkpoint (model_type gemma3, the text model's config in
    text_config, its weights under the language model's prefix of either transformers era, a
    vision tower beside them) loads as the text model: the same logits."""
    from tests.engine.helpers import gemma3_model

    text = gemma3_model(window=8)
    c = text.config
    text_config = dict(
        model_type="gemma3_text",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        sliding_window=c.sliding_window,
        query_pre_attn_scalar=16,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        max_position_embeddings=512,
    )
    tensors = {layout + k[len("model.") :]: v for k, v in hf_state_dict(text).items()}
    tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros(
        (4, 3), np.float32
    )
    tensors["model.multi_modal_projector.mm_input_projection_weight"] = np.zeros((4, 4), np.float32)
    write_safetensors_dir(tmp_path, {"model_type": "gemma3", "text_config": text_config}, tensors)
    model, config, _ = load_model(tmp_path)
    assert config == c
    ids = jnp.asarray([[3, 17, 101, 45, 9, 200, 33, 7, 64, 12, 5, 250]], jnp.int32)
    np.testing.assert_allclose(
        np.asarray(dense_forward(model, ids)),
        np.asarray(dense_forward(text, ids)),
        rtol=1e-6,
        atol=1e-6,
    )
