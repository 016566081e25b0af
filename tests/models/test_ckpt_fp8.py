"""HF checkpoints that ship fp8 weights (``quantization_config`` quant_method "fp8" with 128x128
blocks or per tensor; "compressed-tensors" per channel / tensor / block): the fp8 bits and
scales kept as stored in ``QuantizedLinear(mode="fp8")``, the engine's greedy tokens equal to
the float model's on the dequantized weights, and every other quantization refused."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_fixtures import hf_config_dict, small_config

from jaxkv.engine_config import resolve_engine_config
from jaxkv.entrypoints.cli import main
from jaxkv.models import build_model, hf_state_dict
from jaxkv.models.build import dequantized_model
from jaxkv.models.checkpoint import SafetensorsTensors, write_safetensors_dir
from jaxkv.models.hf_config import config_from_hf
from jaxkv.models.quant import QuantizedLinear, QuantizedLMHead, dequantize, quantize
from jaxkv.models.registry import load_model, load_model_config, resolve_quantization
from jaxkv.models.weights import load_hf_weights
from jaxkv.sampling_params import SamplingParams
from tests.engine.helpers import dense_greedy, make_llm

F8 = ml_dtypes.float8_e4m3fn
B = 128  # the checkpoints' blocks: 128 outputs x 128 inputs
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 15, 200, 7, 42], list(range(3, 30)), [9, 9, 9]]
# a layer each checkpoint keeps in float (listed in its ignore list), quantized at load
FLOAT_LAYER = "model.layers.1.mlp.down_proj"


def _config(**overrides):
    # hidden 128, intermediate 256: every input count divides by 128; k/v (64 outputs) and the
    # head (288 outputs) end in a ragged block of outputs
    kw = dict(hidden_size=128, intermediate_size=256, head_dim=32, tie_word_embeddings=False)
    kw.update(overrides)
    return small_config(**kw)


def _fp8(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``w / scale`` as float8_e4m3fn (scale broadcast over ``w [out, in]``)."""
    return np.clip(w / scale, -448, 448).astype(F8)


def _quantize_stored(w: np.ndarray, strategy: str):
    """A checkpoint's ``(q [out, in] fp8, stored scale)`` of float weight ``w``, as the
    quantizers write it: channel ``[out, 1]``, tensor ``[]``, block ``[ceil(out/128),
    in/128]``."""
    w = w.astype(np.float32)
    n_out, n_in = w.shape
    if strategy == "channel":
        s = np.abs(w).max(axis=1, keepdims=True) / 448
        return _fp8(w, s), s.astype(np.float32)
    if strategy == "tensor":
        s = np.float32(np.abs(w).max() / 448)
        return _fp8(w, s), np.asarray(s, np.float32)
    rows, cols = -(-n_out // B), -(-n_in // B)
    padded = np.zeros((rows * B, cols * B), np.float32)
    padded[:n_out, :n_in] = w
    s = np.abs(padded.reshape(rows, B, cols, B)).max(axis=(1, 3)) / 448  # [rows, cols]
    expanded = np.repeat(np.repeat(s, B, axis=0)[:n_out], B, axis=1)[:, :n_in]
    return _fp8(w, expanded), s.astype(np.float32)


def _expected_scale(stored: np.ndarray, strategy: str, n_out: int) -> np.ndarray:
    """jaxkv's scale of a checkpoint scale, HF orientation: ``[out]`` or ``[out, in/128]``."""
    if strategy == "channel":
        return stored[:, 0]
    if strategy == "tensor":
        return np.full(n_out, stored.reshape(()), np.float32)
    return np.stack([stored[o // B] for o in range(n_out)])  # row block o // 128's scales


def _dequantized(q, scale):  # HF orientation, float32
    n_out, n_in = q.shape
    if scale.ndim == 1:
        return q.astype(np.float32) * scale[:, None]
    return q.astype(np.float32) * np.repeat(scale, n_in // scale.shape[1], axis=1)


QUANT_CONFIGS = {
    "fp8-block": dict(
        quant_method="fp8",
        activation_scheme="dynamic",
        fmt="e4m3",
        weight_block_size=[B, B],
        modules_to_not_convert=["lm_head", FLOAT_LAYER],
    ),
    "fp8-tensor": dict(
        quant_method="fp8", activation_scheme="static", ignored_layers=["lm_head", FLOAT_LAYER]
    ),
}


def _ct_config(strategy: str, fmt: str = "float-quantized", ignore=("lm_head", FLOAT_LAYER)):
    weights = dict(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    weights.update(group_size=None, actorder=None, observer="minmax")
    weights["block_structure"] = [B, B] if strategy == "block" else None
    acts = dict(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    if strategy == "tensor":  # FP8 static: one input scale per layer
        acts.update(strategy="tensor", dynamic=False)
    return dict(
        quant_method="compressed-tensors",
        format=fmt,
        quantization_status="compressed",
        config_groups={
            "group_0": dict(
                targets=["Linear"],
                weights=weights,
                input_activations=acts,
                output_activations=None,
            )
        },
        ignore=list(ignore),
        kv_cache_scheme=None,
        sparsity_config={},
    )


#: case -> (quantization_config, strategy, scale suffix, scalar scale shape, input_scale?)
CASES = {
    "fp8-block": (QUANT_CONFIGS["fp8-block"], "block", "weight_scale_inv", None, False),
    "fp8-tensor": (QUANT_CONFIGS["fp8-tensor"], "tensor", "weight_scale", (), True),
    "ct-channel": (_ct_config("channel"), "channel", "weight_scale", None, False),
    "ct-tensor": (_ct_config("tensor"), "tensor", "weight_scale", (1,), True),
    "ct-block": (_ct_config("block", "naive-quantized"), "block", "weight_scale", None, False),
    # the head stored fp8 too (an empty ignore list but the float layer's)
    "ct-channel-head": (
        _ct_config("channel", ignore=(FLOAT_LAYER,)),
        "channel",
        "weight_scale",
        None,
        False,
    ),
}


def _write_fp8_checkpoint(root, config, case: str, *, seed: int = 0, tied_float=None):
    """An fp8 checkpoint of ``config``'s random float model: every projection (and the head
    in "ct-channel-head") quantized to fp8 with numpy / ml_dtypes, ``FLOAT_LAYER`` and the
    rest stored as bf16. Returns ``(root, {HF weight name: (q, jaxkv scale HF-oriented)}``
    of the fp8 weights, ``float tensors``)."""
    qc, strategy, suffix, scalar_shape, input_scale = CASES[case]
    model = build_model(config, seed=seed)
    floats = {n: np.asarray(t, np.float32) for n, t in hf_state_dict(model).items()}
    tensors, stored = {}, {}
    for name, w in floats.items():
        quantized = name.endswith("proj.weight") and not name.startswith(FLOAT_LAYER)
        quantized |= case == "ct-channel-head" and name == "lm_head.weight"
        if not quantized:
            tensors[name] = w.astype(ml_dtypes.bfloat16)
            continue
        q, s = _quantize_stored(w, strategy)
        prefix = name[: -len("weight")]
        tensors[name] = q
        tensors[prefix + suffix] = s if scalar_shape is None else s.reshape(scalar_shape)
        if input_scale:
            tensors[prefix + "input_scale"] = np.asarray([0.02], np.float32)
        stored[name] = (q, _expected_scale(s, strategy, w.shape[0]))
    hf = dict(hf_config_dict(config), quantization_config=qc)
    write_safetensors_dir(root, hf, tensors)
    return Path(root), stored, tensors


def _modules(model) -> dict[str, nnx.Module]:
    """HF weight name -> the quantized module holding it."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, (QuantizedLinear, QuantizedLMHead)):
            out[".".join(str(p) for p in path) + ".weight"] = node
    return out


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def _reference(config, tensors, stored):
    """The float model of what the fp8 model holds, built from the test's own arithmetic:
    fp8 weights dequantized (``q * scale``), the float layers quantized to fp8 per output
    channel and dequantized (what mode "fp8" does to a float layer), the rest as stored."""
    weights = {}
    for name, arr in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if name in stored:
            weights[name] = _dequantized(*stored[name])
        elif name.endswith("proj.weight") or name == "lm_head.weight":
            q, s = quantize(np.asarray(arr, np.float32).T, "fp8")
            weights[name] = np.asarray(dequantize(q, s)).T
        else:
            weights[name] = np.asarray(arr, np.float32)
    ref = build_model(config, seed=1)
    return load_hf_weights(ref, weights)


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_bits_and_scales_are_kept_as_stored(tmp_path, case):
    config = _config()
    root, stored, tensors = _write_fp8_checkpoint(tmp_path, config, case)
    model, loaded_config, _ = load_model(root)  # quantization None: the checkpoint's fp8
    assert loaded_config == config
    modules = _modules(model)
    assert set(stored) < set(modules)
    for name, module in modules.items():
        assert module.mode == "fp8", name
        linear = isinstance(module, QuantizedLinear)
        q = module.kernel[...] if linear else module.weight[...]
        scale = np.asarray(module.scales())
        if linear:  # [in, out] -> the checkpoint's [out, in]
            q, scale = np.asarray(q).T, scale.T
        if name in stored:  # the checkpoint's bits and its scales, mapped
            want_q, want_scale = stored[name]
            block = None if want_scale.ndim == 1 else B
        else:  # a float layer: fp8 per output channel, quantized at load
            w = np.asarray(tensors[name], np.float32)
            want_q, want_scale = quantize(w.T, "fp8")
            want_q, want_scale, block = want_q.T, want_scale.T, None
        assert module.block == block, name
        np.testing.assert_array_equal(_bits(q), _bits(want_q), name)
        np.testing.assert_array_equal(scale, want_scale, name)
    if "block" in case:  # k_proj's 64 outputs: one ragged row block; [in / 128, out] scales
        k = model.model.layers[0].self_attn.k_proj
        assert k.block_scale[...].shape == (1, 64)
    # quantization="fp8" given explicitly loads the same parameters
    again, _, _ = load_model(root, quantization="fp8")
    a = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    b = dict(nnx.to_flat_state(nnx.state(again, nnx.Param)))
    assert set(a) == set(b)
    for path in a:
        np.testing.assert_array_equal(_bits(a[path][...]), _bits(b[path][...]), path)
    # dequantized, the model is the float model of the test's own dequantization, bit for bit
    ref = dict(nnx.to_flat_state(nnx.state(_reference(config, tensors, stored), nnx.Param)))
    deq = dict(nnx.to_flat_state(nnx.state(dequantized_model(model), nnx.Param)))
    assert set(ref) == set(deq)
    for path in ref:
        np.testing.assert_array_equal(np.asarray(deq[path][...]), np.asarray(ref[path][...]), path)


@pytest.mark.parametrize("case", ["fp8-block", "ct-channel-head"])
def test_engine_greedy_equals_float_model_of_dequantized_weights(tmp_path, case):
    """``LLM(path)`` on an fp8 checkpoint (the worker loads it as fp8): greedy tokens equal
    the dense forward's on the float model of the dequantized weights."""
    config = _config()
    root, stored, tensors = _write_fp8_checkpoint(tmp_path, config, case, seed=5)
    llm = make_llm(str(root), max_model_len=128)
    worker_model = llm.llm_engine.engine_core.model_executor.driver_worker.worker.model
    assert isinstance(worker_model.model.layers[0].self_attn.q_proj, QuantizedLinear)
    assert worker_model.model.layers[0].self_attn.q_proj.mode == "fp8"
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ref = _reference(config, tensors, stored)
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.outputs[0].token_ids) == dense_greedy(ref, prompt, 8, pad_to=64), prompt


def test_tied_head_is_quantized_from_the_float_embedding(tmp_path):
    config = _config(tie_word_embeddings=True)
    root, stored, tensors = _write_fp8_checkpoint(tmp_path, config, "ct-block")
    model, _, _ = load_model(root)
    embedding = np.asarray(tensors["model.embed_tokens.weight"], np.float32)  # [V, hidden]
    q, scale = quantize(embedding.T, "fp8")  # per vocabulary row, as mode "fp8" does
    assert model.lm_head.block is None
    np.testing.assert_array_equal(_bits(model.lm_head.weight[...]), _bits(q.T))
    np.testing.assert_array_equal(np.asarray(model.lm_head.scale[...]), scale)
    k = model.model.layers[1].self_attn.k_proj
    np.testing.assert_array_equal(_bits(k.kernel[...]), _bits(stored[_name(1, "k")][0].T))


def _name(layer: int, proj: str) -> str:
    return f"model.layers.{layer}.self_attn.{proj}_proj.weight"


def test_fp8_kernels_take_a_byte_per_weight(tmp_path):
    config = _config()
    root, _, _ = _write_fp8_checkpoint(tmp_path, config, "ct-channel")
    model, _, _ = load_model(root)
    for name, module in _modules(model).items():
        q = module.kernel if isinstance(module, QuantizedLinear) else module.weight
        assert q[...].dtype == F8 and q[...].dtype.itemsize == 1, name
    # the front end's view and the plan's see the fp8 weights
    assert load_model_config(root)[0] == config
    assert resolve_quantization(root) == "fp8" == resolve_quantization(root, "fp8")
    assert resolve_quantization("tiny-llama") is None
    assert resolve_engine_config(str(root))[3].quantization == "fp8"  # the engine's config


def test_f8_tensors_read_back_bit_for_bit(tmp_path):
    q = np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32).astype(F8)
    write_safetensors_dir(tmp_path, {}, {"w": q, "s": np.float32(0.5).reshape(())})
    with SafetensorsTensors(tmp_path) as source:
        assert source.stored_dtype("w") == "F8_E4M3"
        np.testing.assert_array_equal(_bits(source.read("w")), _bits(q))
        np.testing.assert_array_equal(
            _bits(source.read("w", (slice(1, 3), slice(2, 7)))), _bits(q[1:3, 2:7])
        )
        assert source.read("s").shape == ()


def test_int8_on_an_fp8_checkpoint_is_refused(tmp_path):
    config = _config()
    root, _, _ = _write_fp8_checkpoint(tmp_path, config, "fp8-block")
    for call in (
        lambda: load_model(root, quantization="int8"),
        lambda: load_model_config(root, quantization="int8"),
        lambda: resolve_quantization(root, "int8"),
        lambda: make_llm(str(root), quantization="int8", max_model_len=128),
    ):
        with pytest.raises(ValueError, match=r"quantization='int8'.*'fp8'"):
            call()


def test_block_checkpoint_needs_inputs_in_whole_blocks(tmp_path):
    config = small_config(tie_word_embeddings=False)  # hidden 64: no whole block of 128 inputs
    root, _, _ = _write_fp8_checkpoint(tmp_path, config, "fp8-block")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.\S+\.weight' has 64 inputs"):
        load_model(root)


def _qc(method="compressed-tensors", **weights):
    if method != "compressed-tensors":
        return dict(quant_method=method, bits=4, group_size=128)
    qc = _ct_config("channel")
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


@pytest.mark.parametrize(
    "qc, named",
    [
        (_qc("awq"), "'awq'"),
        (_qc("gptq"), "'gptq'"),
        (_qc("bitsandbytes"), "'bitsandbytes'"),
        (dict(quant_method="fp8", fmt="e5m2"), "fmt='e5m2'"),
        (dict(quant_method="fp8", weight_block_size=[128]), r"weight_block_size=\[128\]"),
        (_qc(num_bits=4, type="int"), "num_bits=4"),
        (_qc(type="int"), "type='int'"),
        (_qc(strategy="group", group_size=128), "strategy='group'"),
        (_qc(strategy="tensor_group", group_size=16), "strategy='tensor_group'"),
        (_qc(dynamic=True), "dynamic=True"),
        (_qc(symmetric=False), "symmetric=False"),
        ({**_qc(), "format": "pack-quantized"}, "format='pack-quantized'"),
        ({**_qc(), "format": "mixed-precision"}, "group_0.format=None"),
        ({**_qc(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
        ("int8", "'int8'"),
    ],
)
def test_other_quantization_configs_are_refused(tmp_path, qc, named):
    d = dict(hf_config_dict(_config()), quantization_config=qc)
    with pytest.raises(ValueError, match=named):
        config_from_hf(d)
    write_safetensors_dir(tmp_path, d, {})
    with pytest.raises(ValueError, match=named):
        load_model_config(tmp_path)
    with pytest.raises(ValueError, match=named):
        load_model(tmp_path)


def test_plan_sees_the_fp8_weights(tmp_path, capsys, monkeypatch):
    """``jaxkv plan`` on an fp8 checkpoint: the plan, and the step report's weights fp8 (the
    report itself, a deviceless GPU compile, is replaced by one that says what it got)."""
    import jaxkv.gpu_aot

    config = _config()
    root, _, _ = _write_fp8_checkpoint(tmp_path, config, "fp8-block")
    monkeypatch.setattr(jaxkv.gpu_aot, "prepare_environment", lambda: None)
    monkeypatch.setattr(
        jaxkv.gpu_aot,
        "gpu_step_report",
        lambda cfg, *, target, quantization, **sizes: f"report: {quantization} weights",
    )
    argv = ["plan", "--model", str(root), "--max-model-len", "128", "--gpu", "h200"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "report: fp8 weights" in out
    assert main(argv + ["--quantization", "int8"]) != 0
    assert "quantization='int8'" in capsys.readouterr().err
