"""Loading without a random init, configs without weights, and (in a subprocess with two
host devices, ``load_sharded_cases.py``) loading shard by shard onto a mesh."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ckpt_fixtures import hf_config_dict, small_config, write_llama_gguf
from no_random_init import ConcreteRandomInitError, forbid_concrete_random_init

from jaxkv.models import build_model, hf_state_dict
from jaxkv.models.checkpoint import (
    GGUFTensors,
    SafetensorsTensors,
    read_gguf,
    write_safetensors_dir,
)
from jaxkv.models.checkpoint.smollm2 import SMOLLM2_NAME, smollm2_gguf_path
from jaxkv.models.registry import load_model, load_model_config
from tests.two_host_devices import run_cases_on_two_host_devices


def _checkpoints(tmp_path):
    """An HF directory (with the GGUF's tokenizer saved into it) and a GGUF file."""
    config = small_config("tiny-llama")
    tensors = hf_state_dict(build_model(config, seed=3))
    write_llama_gguf(tmp_path / "m.gguf", hf_config_dict(config), tensors)
    write_safetensors_dir(tmp_path / "hf", hf_config_dict(config), tensors)
    read_gguf(tmp_path / "m.gguf")[2].save(tmp_path / "hf")
    return tmp_path / "hf", tmp_path / "m.gguf"


def test_guard_catches_a_concrete_init(monkeypatch):
    """The guard the next test relies on: an eager init raises, an abstract one passes."""
    config = small_config("tiny-hybrid")
    with forbid_concrete_random_init(monkeypatch):
        with pytest.raises(ConcreteRandomInitError):
            build_model(config, seed=0)
        build_model(config, seed=0, abstract=True)


@pytest.mark.parametrize("kind", ["hf", "gguf"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoints_load_without_random_init(tmp_path, monkeypatch, kind, dtype):
    """No random initialiser runs on real values while a checkpoint loads (the model is
    built with nnx.eval_shape and each parameter comes from its tensor), and the result is
    the checkpoint's values cast to dtype."""
    hf_dir, gguf_file = _checkpoints(tmp_path)
    path = hf_dir if kind == "hf" else gguf_file
    with forbid_concrete_random_init(monkeypatch):
        model, config, tokenizer = load_model(path, dtype=dtype, seed=7)
    assert tokenizer is not None and config.dtype == dtype
    src = build_model(small_config("tiny-llama"), seed=3)
    got, want = hf_state_dict(model), hf_state_dict(src)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name].astype(got[name].dtype), err_msg=name)
    leaf = nnx.state(model, nnx.Param)["model"]["layers"][1]["mlp"]["up_proj"]["kernel"][...]
    assert str(leaf.dtype) == dtype


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid", "hf", "gguf"])
def test_load_model_config_reads_no_weights(tmp_path, monkeypatch, name):
    """load_model_config gives load_model's config and tokenizer without reading a tensor
    or initialising a parameter."""
    hf_dir, gguf_file = _checkpoints(tmp_path)
    source = {"hf": hf_dir, "gguf": gguf_file}.get(name, name)

    def no_read(*args, **kwargs):
        raise AssertionError("a tensor was read")

    with forbid_concrete_random_init(monkeypatch):
        monkeypatch.setattr(SafetensorsTensors, "read", no_read)
        monkeypatch.setattr(GGUFTensors, "read", no_read)
        config, tokenizer = load_model_config(source, dtype="bfloat16")
    monkeypatch.undo()
    _, loaded_config, loaded_tokenizer = load_model(source, dtype="bfloat16")
    assert config == loaded_config
    assert (tokenizer is None) == (loaded_tokenizer is None) == (name.startswith("tiny"))
    if tokenizer is not None:
        assert tokenizer.encode("hello world 12") == loaded_tokenizer.encode("hello world 12")
        assert tokenizer.eos_token_id == loaded_tokenizer.eos_token_id


def test_load_model_config_errors(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model_config("tiny-llama", dtype="float16")
    with pytest.raises(ValueError, match="nor an existing path"):
        load_model_config(tmp_path / "nope")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="neither an HF checkpoint directory nor a .gguf file"):
        load_model_config(tmp_path / "x.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_model_config(tmp_path / "empty")


def test_smollm2_config_from_metadata():
    try:
        smollm2_gguf_path(download=False)
    except RuntimeError:
        pytest.skip("the SmolLM2 GGUF is not cached")
    config, tokenizer = load_model_config(SMOLLM2_NAME, use_cache=False)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert tokenizer is not None


def test_sharded_cases_on_two_host_devices():
    """Runs tests/models/load_sharded_cases.py on two CPU devices; every case must pass."""
    run_cases_on_two_host_devices("tests/models/load_sharded_cases.py")
