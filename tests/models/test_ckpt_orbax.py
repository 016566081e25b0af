"""orbax save/restore of model parameters, and load_model's built-in names."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_fixtures import small_config

from jaxkv.models import build_model
from jaxkv.models.checkpoint import read_saved_config, restore_params, save_params
from jaxkv.models.registry import load_model


@pytest.mark.parametrize("name,dtype", [("tiny-llama", "float32"), ("tiny-hybrid", "bfloat16")])
def test_save_restore_identical_params(tmp_path, name, dtype):
    config = small_config(name, dtype=dtype)
    model = build_model(config, seed=7)
    save_params(model, tmp_path / "ckpt")
    assert read_saved_config(tmp_path / "ckpt") == config
    restored = restore_params(config, tmp_path / "ckpt")
    want = nnx.to_flat_state(nnx.state(model, nnx.Param))
    got = dict(nnx.to_flat_state(nnx.state(restored, nnx.Param)))
    assert len(got) == len(want)
    for path, var in want:
        a, b = np.asarray(var[...]), np.asarray(got[path][...])
        assert a.dtype == b.dtype == np.dtype(jax.numpy.dtype(dtype)), path
        np.testing.assert_array_equal(a, b, err_msg=str(path))


def test_restore_untied_lm_head_saved_as_a_linear_kernel(tmp_path):
    """Checkpoints written before the LM head became vocab-major hold ``lm_head.kernel
    [hidden, V]`` (an nnx.Linear): they restore, transposed into ``lm_head.weight [V, hidden]``."""
    import shutil

    import orbax.checkpoint as ocp

    config = small_config(tie_word_embeddings=False)
    model = build_model(config, seed=3)
    save_params(model, tmp_path / "ckpt")
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    pure["lm_head"] = {"kernel": pure["lm_head"]["weight"].T}
    values = jax.tree_util.tree_map(lambda x: {"value": x}, pure)  # nnx's saved layout
    shutil.rmtree(tmp_path / "ckpt" / "params")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt" / "params", values)
        ckptr.wait_until_finished()
    restored = restore_params(config, tmp_path / "ckpt")
    want = nnx.to_flat_state(nnx.state(model, nnx.Param))
    got = dict(nnx.to_flat_state(nnx.state(restored, nnx.Param)))
    assert len(got) == len(want)
    for path, var in want:
        np.testing.assert_array_equal(
            np.asarray(var[...]), np.asarray(got[path][...]), err_msg=str(path)
        )


def test_orbax_errors(tmp_path):
    config = small_config()
    save_params(build_model(config), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="already exists"):
        save_params(build_model(config), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        restore_params(small_config(num_hidden_layers=3), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="no orbax checkpoint"):
        restore_params(config, tmp_path / "nothing")


def test_load_model_builtin_random_names():
    model, config, tokenizer = load_model("tiny-llama", seed=1)
    assert tokenizer is None and config.architecture == "llama" and config.num_hidden_layers == 8
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny-llama", dtype="float64")
    with pytest.raises(ValueError, match="not a built-in model"):
        load_model("no-such-model")
