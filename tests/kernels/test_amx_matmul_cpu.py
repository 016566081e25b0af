"""bf16 matmuls with weights packed at load (``pallas_kernels.amx``,
``cpu_kernels/amx_matmul.cc``: AMX tiles, or AVX512-BF16 dot products on CPUs without AMX) and
the layers that use them (``models.cpu_layout``): the layout on literal values, products equal
to XLA's bf16 dot with f32 results, and an engine whose linears run packed producing the tokens
of one that does not. The layout tests run everywhere; the rest need a CPU with AMX or
AVX512-BF16 (Intel Cooper Lake / Sapphire Rapids, AMD Zen 4 and later) and skip elsewhere.
On an AMX machine products of more than ``amx.FEW_ROWS`` rows run on the tiles, on the others
on the dot products; the products are checked both ways (``tiles=False``: the dot products
on any machine)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.models import cpu_layout
from jaxkv.models.layers import linear
from jaxkv.pallas_kernels import amx

needs_amx = pytest.mark.skipif(
    not amx.available(), reason="no AMX or AVX512-BF16 here (CPU, build or JAXKV_CPU_AMX=0)"
)


def _bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def test_pack_puts_pairs_of_inputs_side_by_side_in_tiles():
    k, n = 64, 40  # two input blocks, two column blocks (the second one ragged)
    w = jnp.asarray(np.arange(k * n).reshape(k, n) % 251, jnp.bfloat16)  # exact in bf16
    p = np.asarray(amx.pack(w).astype(jnp.float32))
    assert p.shape == amx.packed_shape(k, n) == (2, 2, 2, 16, 32)
    wn = np.asarray(w.astype(jnp.float32))
    # column block 0, input block 1, tile 1 (columns 16-31), row 3: inputs 32 + 6 and 32 + 7
    assert list(p[0, 1, 1, 3, :4]) == [wn[38, 16], wn[39, 16], wn[38, 17], wn[39, 17]]
    # column block 1 holds columns 32-39, then zeros
    assert list(p[1, 0, 0, 0, :2]) == [wn[0, 32], wn[1, 32]]
    assert (p[1, :, 0, :, 16:] == 0).all() and (p[1, :, 1] == 0).all()


@pytest.mark.parametrize("k,n", [(576, 1536), (100, 70), (1, 1), (33, 65)])
def test_unpack_restores_the_kernel(k, n):
    w = _bf16(np.random.default_rng(k), (k, n))
    assert (amx.unpack(amx.pack(w), k, n) == w).all()


@needs_amx
@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 576, 1536),  # a decode row against SmolLM2's up projection (dot products)
        (3, 100, 70),  # a few rows, inputs padded, a ragged column block (dot products)
        (4, 64, 17),  # the most rows of the dot products
        (64, 1536, 576),  # 64 sequences against its down projection
        (37, 100, 70),  # ragged rows, inputs (not a multiple of 32: x copied) and columns
        (160, 64, 96),  # two row groups of 4 blocks: chunks of column blocks
        (300, 576, 192),  # a prefill chunk, ragged last row block read through the copy
        (5, 2048, 33),
        (2, 64, 224),  # two rows: blocks taken four, then two, then one at a time
        (7, 96, 200),  # a group of six rows and one more; pairs of column blocks, then one
        (400, 40, 100),  # groups of 96 rows (dot products), inputs padded
    ],
)
@pytest.mark.parametrize("tiles", [True, False], ids=["tiles-if-any", "dot-products"])
def test_matmul_equals_xla_bf16_dot_with_f32_results(m, k, n, tiles):
    rng = np.random.default_rng(m + k + n)
    x, w = _bf16(rng, (m, k)), _bf16(rng, (k, n))
    call = functools.partial(amx.matmul, tiles=tiles)
    got = jax.jit(call, static_argnums=2)(x, amx.pack(w), n)
    want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    assert got.shape == (m, n) and got.dtype == jnp.float32
    # bf16 products are exact in f32; only the order of the f32 sums differs
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * k**0.5)
    # bf16 results: the same sums rounded to nearest even (the kernel's own rounding)
    got16 = jax.jit(call, static_argnums=(2, 3))(x, amx.pack(w), n, jnp.bfloat16)
    assert got16.dtype == jnp.bfloat16
    assert (got16 == got.astype(jnp.bfloat16)).all()


@needs_amx
def test_matmul_refuses_a_layout_that_does_not_fit():
    x = jnp.ones((4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="packed as"):
        amx.matmul(x, amx.pack(jnp.ones((32, 64), jnp.bfloat16)), 64)


@needs_amx
@pytest.mark.parametrize("use_bias", [False, True])
def test_amx_linear_equals_the_bf16_linear(use_bias):
    lin = linear(96, 80, use_bias=use_bias, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    if use_bias:
        lin.bias[...] = _bf16(np.random.default_rng(1), (80,))
    packed = cpu_layout.AmxLinear.from_linear(lin)
    x = _bf16(np.random.default_rng(2), (3, 7, 96))
    got, want = jax.jit(packed.__call__)(x), jax.jit(lin.__call__)(x)
    assert got.shape == want.shape == (3, 7, 80) and got.dtype == want.dtype == jnp.bfloat16
    assert (packed.kernel() == lin.kernel[...]).all()
    # same bf16 inputs and f32 sums rounded once: at most one bf16 ulp apart (sum order)
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert (diff <= 2.0**-7 * np.abs(np.asarray(want, np.float32)) + 1e-2).all()


@needs_amx
def test_pack_for_cpu_copies_the_model_and_packs_only_bf16_linears():
    from jaxkv.models.registry import load_model

    model, _, _ = load_model("tiny-llama", dtype="bfloat16")
    packed = cpu_layout.pack_for_cpu(model)
    assert packed is not model and cpu_layout.packed_linears(model) == 0
    n_linear = sum(isinstance(m, nnx.Linear) for _, m in nnx.iter_graph(model))
    assert cpu_layout.packed_linears(packed) == n_linear > 0
    f32, _, _ = load_model("tiny-llama", dtype="float32")
    assert cpu_layout.pack_for_cpu(f32) is f32


def test_pack_for_cpu_leaves_models_alone_without_amx(monkeypatch):
    from jaxkv.models.registry import load_model

    monkeypatch.setenv("JAXKV_CPU_AMX", "0")
    model, _, _ = load_model("tiny-llama", dtype="bfloat16")
    assert not amx.available() and cpu_layout.pack_for_cpu(model) is model


@needs_amx
def test_engine_on_amx_tiles_decodes_the_tokens_of_the_xla_engine(monkeypatch):
    """Greedy tokens equal until a near-tie: the two engines' sums differ in order only, so
    where they part, the tile engine's token is within 0.05 nats of the XLA engine's best."""
    from jaxkv import LLM, SamplingParams

    prompts = [[5, 17, 99, 3, 42] * k for k in (1, 3, 9)] + [list(range(100, 170))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    kw = dict(dtype="bfloat16", kv_cache_memory_bytes=8 << 20, max_num_seqs=4, max_model_len=256)
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("JAXKV_CPU_AMX", flag)
        llm = LLM("tiny-llama", **kw)
        runner = llm.llm_engine.runner
        on_tiles = cpu_layout.packed_linears(nnx.merge(runner.graphdef, runner.state))
        assert (on_tiles > 0) == (flag == "1")
        runs.append(
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        )
    equal = 0
    for tiles, xla in zip(*runs):
        a, b = tiles.outputs[0], xla.outputs[0]
        part = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        equal += part is None
        if part is not None:
            best = max(lp.logprob for lp in b.logprobs[part].values())
            assert a.token_ids[part] in b.logprobs[part], (part, a.token_ids, b.token_ids)
            assert best - b.logprobs[part][a.token_ids[part]].logprob < 0.05
    assert equal >= len(prompts) // 2


@needs_amx
def test_pack_for_cpu_leaves_abstract_models_alone():
    from jaxkv.models import build_model, get_config

    cfg = get_config("tiny-llama", dtype="bfloat16")
    abstract = nnx.eval_shape(lambda: build_model(cfg, seed=0))
    assert cpu_layout.pack_for_cpu(abstract) is abstract


def test_unpack_linears_restores_the_bf16_linears_of_a_packed_model():
    """What the GPU and TPU compiles of a CPU engine's programs take (``portable_model``):
    packed by hand here, so it runs without AMX too."""
    from jaxkv.models.quant import replace_module
    from jaxkv.models.registry import load_model

    model, _, _ = load_model("tiny-llama", dtype="bfloat16")
    assert cpu_layout.unpack_linears(model) is model  # nothing packed: nothing to do
    paths = [p for p, m in nnx.iter_graph(model) if p and isinstance(m, nnx.Linear)]
    packed = nnx.merge(*nnx.split(model))
    for path in paths:
        replace_module(packed, path, cpu_layout.AmxLinear.from_linear)
    assert cpu_layout.packed_linears(packed) == len(paths) > 0
    back = cpu_layout.unpack_linears(packed)
    assert cpu_layout.packed_linears(back) == 0 and cpu_layout.packed_linears(packed) > 0
    want = dict(nnx.to_flat_state(nnx.state(model)))
    got = dict(nnx.to_flat_state(nnx.state(back)))
    assert got.keys() == want.keys()
    for key, v in want.items():
        assert (
            got[key].get_value().dtype == v.get_value().dtype
            and (got[key].get_value() == v.get_value()).all()
        ), key
    assert nnx.graphdef(back) == nnx.graphdef(model)


@needs_amx
@pytest.mark.parametrize("rows", [5, 33, 64])
@pytest.mark.parametrize("transposed", [False, True])
def test_lm_head_on_tiles_equals_xla(rows, transposed):
    """The bf16 LM head above ``amx.FEW_ROWS`` rows: the head ``[V, hidden]`` read in place as
    the tiles' rows, the hidden states packed per call; f32 logits of XLA's bf16 products."""
    from jaxkv.models.quant import float_matmul

    rng = np.random.default_rng(rows)
    w = _bf16(rng, (1000, 96))  # [V, hidden]
    x = _bf16(rng, (rows, 96))
    got = jax.jit(
        lambda x, w: float_matmul(x, w, jnp.float32, out_major=True, transposed=transposed)
    )(x, w)
    want = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
    want = want.T if transposed else want
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    hlo = jax.jit(lambda x, w: float_matmul(x, w, jnp.float32, out_major=True)).lower(x, w)
    assert "jaxkv_amx_matmul_cpu" in hlo.as_text()


@needs_amx
@pytest.mark.parametrize("vocab, rows", [(7, 5), (1000, 5), (5000, 64), (2000, 130)])
@pytest.mark.parametrize("tiles", [True, False])
def test_first_max_is_the_argmax_of_the_lm_head_products(vocab, rows, tiles):
    """``amx.out_major_first_max`` equals ``argmax`` over the f32 logits the same kernel
    writes (the same sums), across group and work-item borders (96 / 128 rows of the head)."""
    rng = np.random.default_rng(vocab + rows)
    w = _bf16(rng, (vocab, 64))  # [V, hidden]
    x = _bf16(rng, (rows, 64))
    logits = amx.out_major_matmul(x, w, jnp.float32, transposed=False)  # [R, V]
    got = jax.jit(functools.partial(amx.out_major_first_max, tiles=tiles))(x, w)
    assert got.shape == (rows,) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(logits, axis=-1)))


@needs_amx
def test_first_max_takes_the_first_of_ties_and_the_first_nan():
    """Literal heads: equal maxima in rows of different work items (the first wins), a NaN
    anywhere (the first NaN wins, as jnp.argmax), every logit -inf (row 0)."""
    w = jnp.zeros((400, 32), jnp.bfloat16).at[250].set(1.0).at[130].set(1.0).at[390].set(1.0)
    x = jnp.ones((6, 32), jnp.bfloat16).at[1].set(-1.0)  # row 1: every logit <= 0, first is 0
    np.testing.assert_array_equal(amx.out_major_first_max(x, w), [130, 0, 130, 130, 130, 130])
    w_nan = w.at[300, 0].set(jnp.nan).at[200, 0].set(jnp.nan)
    np.testing.assert_array_equal(amx.out_major_first_max(x, w_nan), [200] * 6)
    w_inf = jnp.full((300, 32), -jnp.inf, jnp.bfloat16)
    np.testing.assert_array_equal(amx.out_major_first_max(x[:5], w_inf), [0, 0, 0, 0, 0])


def test_first_max_refuses_shapes_it_does_not_take():
    x = jnp.zeros((5, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        amx.out_major_first_max(x, jnp.zeros((100, 48), jnp.bfloat16))
    with pytest.raises(ValueError, match="vocabulary"):
        amx.out_major_first_max(x[:, :32], jnp.zeros((0, 32), jnp.bfloat16))


@needs_amx
def test_greedy_engine_takes_its_tokens_from_the_first_max_kernel(monkeypatch):
    """A bf16 engine's greedy program (8 rows) reads its tokens off the first-max kernel, and
    they equal the general sampler's (which asks for logprobs, so it takes the logits): the
    same f32 sums, so the same tokens, no near-tie excepted."""
    from jaxkv import LLM, SamplingParams

    calls = []
    real = amx.out_major_first_max
    monkeypatch.setattr(
        amx, "out_major_first_max", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw)
    )
    prompts = [{"prompt_token_ids": [5 + i, 17, 99, 3, 42] * (1 + i % 3)} for i in range(8)]
    llm = LLM(
        "tiny-llama",
        dtype="bfloat16",
        kv_cache_memory_bytes=8 << 20,
        max_num_seqs=8,
        max_model_len=256,
    )
    runs = [
        llm.generate(
            prompts,
            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=logprobs),
            use_tqdm=False,
        )
        for logprobs in (None, 1)
    ]
    assert calls and all(shape[0] > amx.FEW_ROWS for shape in calls)
    for greedy, sampled in zip(*runs):
        assert greedy.outputs[0].token_ids == sampled.outputs[0].token_ids


@needs_amx
@pytest.mark.parametrize("m, k, n", [(1, 64, 96), (5, 576, 1536), (64, 96, 200), (300, 40, 33)])
@pytest.mark.parametrize("tiles", [True, False])
def test_silu_gated_matmul_equals_the_unfused_swiglu(m, k, n, tiles):
    """One kernel for ``silu(x @ gate) * (x @ up)``: the values of XLA's bf16 products, SiLU
    and product rounded as ``GatedMLP`` rounds them, exactly (ragged K and N included)."""
    from jaxkv.models.layers import gated_product

    rng = np.random.default_rng(m + k + n)
    x = _bf16(rng, (m, k))
    gate, up = _bf16(rng, (k, n)) * 0.3, _bf16(rng, (k, n)) * 0.3
    got = jax.jit(functools.partial(amx.silu_gated_matmul, n=n, tiles=tiles))(
        x, amx.pack(gate), amx.pack(up)
    )

    def project(w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    want = gated_product("silu", project(gate), project(up))
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@needs_amx
def test_packed_swiglu_mlp_runs_one_gated_kernel_and_equals_the_bf16_mlp():
    """A packed SwiGLU ``GatedMLP`` takes its hidden layer from the gated kernel (one call in
    its program, no separate gate / up products) and equals the unpacked MLP's output; a
    GeGLU one keeps two products."""
    from jaxkv.models.layers import GatedMLP

    rng = np.random.default_rng(3)
    x = _bf16(rng, (7, 64))
    for act, gated_calls in (("silu", 1), ("gelu_pytorch_tanh", 0)):
        mlp = GatedMLP(64, 96, act=act, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        packed = cpu_layout.pack_for_cpu(mlp)
        assert cpu_layout.packed_linears(packed) == 3
        got = jax.jit(lambda x, m=packed: m(x))(x)
        np.testing.assert_array_equal(
            np.asarray(got, np.float32), np.asarray(jax.jit(lambda x, m=mlp: m(x))(x), np.float32)
        )
        hlo = jax.jit(lambda x, m=packed: m(x)).lower(x).as_text()
        assert hlo.count("jaxkv_bf16_gated_cpu") == gated_calls
        assert hlo.count("jaxkv_amx_matmul_cpu") == 3 - 2 * gated_calls


def test_silu_gated_matmul_refuses_a_layout_that_does_not_fit():
    x = jnp.zeros((4, 64), jnp.bfloat16)
    packed = amx.pack(jnp.zeros((64, 96), jnp.bfloat16))
    with pytest.raises(ValueError, match="gate / up packed"):
        amx.silu_gated_matmul(x, packed, amx.pack(jnp.zeros((64, 64), jnp.bfloat16)), 96)
