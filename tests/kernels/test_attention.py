"""Backends equal the reference: block sizes, head dims, GQA ratios, decode / mixed / edge lengths,
random block-table permutations, NaN in every page nobody may read, window, soft-cap, fp8.

One test class per backend: ``TestXla`` and ``TestCpu`` (C++ kernel) run the full grid;
``TestPallas`` (interpret mode on CPU, compiled on GPU) runs a representative subset.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv.pallas_kernels as pk
from jaxkv.pallas_kernels.testing import make_batch

ON_GPU = jax.default_backend() == "gpu"

# (q_lens, kv_lens) scenarios; table width is chosen so the longest length fills it exactly.
SCENARIOS = {
    # pure decode: kv_len 1, an exact multiple of bs (2 * bs), the longest the table allows.
    "decode": lambda bs: ([1, 1, 1, 1], [1, 2 * bs, 3 * bs - 3, 4 * bs]),
    # mixed: a chunk in the middle of a sequence, a whole prompt at the table's max length,
    # a 2-token chunk and two decodes.
    "mixed": lambda bs: ([5, 4 * bs, 2, 1, 1], [bs + 7, 4 * bs, 3, 1, 2 * bs]),
    # one long decode: the XLA backend spreads its 37 blocks over several work items.
    "single": lambda bs: ([1], [37 * bs - 5]),
    # ragged decodes (1 key .. 37 blocks) for the XLA backend's decode work items.
    "ragged": lambda bs: ([1] * 7, [1, 37 * bs - 5, 2 * bs, 3, 9 * bs + 1, bs, 5 * bs]),
    # 16 decodes of 11..70 blocks: enough keys for the C++ kernel to cut its work into parts.
    "long": lambda bs: ([1] * 16, [(11 + 4 * i) * bs - i for i in range(16)]),
    # prefill tiles: a 70-row chunk after 130 cached keys, a 33-row prompt (a tile of 32 + 1
    # row), a decode, a 2-row chunk.
    "chunked": lambda bs: ([70, 33, 1, 2], [200, 33, 90, 2 * bs + 1]),
}


def build_case(
    *,
    scenario,
    block_size,
    head_size,
    group,
    num_kv_heads=2,
    cache_dtype="float32",
    q_dtype=jnp.float32,
    sliding_window=None,
    soft_cap=None,
    fp8_scale=None,
    extra_table=0,
    seed=0,
    max_q_len="auto",
    pad=True,
):
    """One case's batch, its ``paged_attention`` keyword arguments and max_q_len (also
    compiled for an H200 by tests/gpu_aot/test_h200_kernel_tests.py)."""
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = SCENARIOS[scenario](block_size)
    width = max(-(-kl // block_size) for kl in kv_lens) + extra_table
    b = make_batch(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        block_size=block_size,
        num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        cache_dtype=cache_dtype,
        q_dtype=q_dtype,
        num_seq_rows=len(q_lens) + (2 if pad else 0),
        num_tokens=sum(q_lens) + (3 if pad else 0),
        max_blocks=width,
        sliding_window=sliding_window,
        kv_scale=fp8_scale,
    )
    kw = dict(
        sm_scale=head_size**-0.5,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=fp8_scale,
        v_scale=fp8_scale,
    )
    return b, kw, b.max_q_len if max_q_len == "auto" else max_q_len


def run_case(backend, interpret, *, as_bytes=False, **case):
    b, kw, mq = build_case(**case)
    args = b.attention_args()
    want = jax.jit(functools.partial(pk.paged_attention, backend="reference", **kw))(*args)
    if as_bytes:  # the engine's form: the byte view plus kv_dtype
        from jaxkv.pallas_kernels.layout import typed_to_bytes

        args = (args[0], typed_to_bytes(args[1]), *args[2:])
        kw.update(kv_dtype=case.get("cache_dtype", "float32"))
    got = jax.jit(
        functools.partial(
            pk.paged_attention, backend=backend, interpret=interpret, max_q_len=mq, **kw
        )
    )(*args)
    assert got.shape == b.q.shape and got.dtype == b.q.dtype
    got = np.asarray(got.astype(jnp.float32))
    want = np.asarray(want.astype(jnp.float32))
    assert not np.isnan(want).any() and not np.isnan(got).any()
    n_real = int(b.query_start_loc[int(b.num_seqs)])
    assert (got[n_real:] == 0).all(), "padding rows must be zero"
    if b.q.dtype != jnp.float32 or backend == "pallas":
        tol = 2e-2
    elif jax.default_backend() == "gpu":
        # f32 dots at jax's default precision run as TF32 on the GPU (10-bit mantissa): on an
        # H200 the XLA backend's prefill tiles differed from the HIGHEST-precision reference by
        # up to 9.1e-4 (2026-12-04). Its decode path (elementwise sums) stays within 2e-5.
        tol = 5e-3
    else:
        tol = 2e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


GRID = [(bs, hd, g) for bs, hd in ((8, 128), (16, 64), (32, 128)) for g in (1, 4, 8)]
FEATURES = [  # sliding_window, soft_cap, cache_dtype, q_dtype, fp8 scale
    (1, None, "float32", jnp.float32, None),
    (5, None, "float32", jnp.float32, None),
    (20, 10.0, "bfloat16", jnp.bfloat16, None),
    (None, 5.0, "float32", jnp.float32, None),
    (None, None, "fp8", jnp.bfloat16, 0.05),
    (9, 30.0, "fp8", jnp.float32, 0.5),
    (None, None, "float16", jnp.float16, None),
]


class TestXla:
    """Full grid. Subclasses override the backend and which cases they run."""

    backend, interpret = "xla", False

    def check(self, **kw):
        run_case(self.backend, self.interpret, **kw)

    @pytest.mark.parametrize("block_size,head_size,group", GRID)
    def test_mixed_grid(self, block_size, head_size, group):
        self.check(scenario="mixed", block_size=block_size, head_size=head_size, group=group)

    @pytest.mark.parametrize("block_size,head_size,group", [(8, 64, 8), (16, 128, 1), (32, 64, 4)])
    def test_decode(self, block_size, head_size, group):
        self.check(scenario="decode", block_size=block_size, head_size=head_size, group=group)

    @pytest.mark.parametrize("sliding_window,soft_cap,cache_dtype,q_dtype,fp8_scale", FEATURES)
    def test_features(self, sliding_window, soft_cap, cache_dtype, q_dtype, fp8_scale):
        self.check(
            scenario="mixed",
            block_size=8,
            head_size=64,
            group=4,
            cache_dtype=cache_dtype,
            q_dtype=q_dtype,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            fp8_scale=fp8_scale,
        )

    @pytest.mark.parametrize(
        "sliding_window,cache_dtype,fp8_scale", [(6, "float32", None), (None, "fp8", 0.25)]
    )
    def test_decode_features(self, sliding_window, cache_dtype, fp8_scale):
        self.check(
            scenario="decode",
            block_size=8,
            head_size=64,
            group=2,
            cache_dtype=cache_dtype,
            sliding_window=sliding_window,
            fp8_scale=fp8_scale,
        )

    @pytest.mark.parametrize("max_q_len", [0, 64])
    def test_wide_table_and_loose_max_q_len(self, max_q_len):
        """Extra garbage table columns and a loose (or absent) max_q_len change nothing."""
        self.check(
            scenario="mixed",
            block_size=16,
            head_size=64,
            group=2,
            extra_table=3,
            max_q_len=max_q_len,
        )

    def test_no_padding(self):
        self.check(scenario="mixed", block_size=8, head_size=64, group=1, pad=False)

    @pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (45, 20.0)])
    def test_single_long_decode(self, sliding_window, soft_cap):
        """One row over many work items merged by their maxima (the window empties some)."""
        self.check(
            scenario="single",
            block_size=8,
            head_size=64,
            group=4,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )


@pytest.mark.parametrize(
    "as_bytes,sliding_window,soft_cap", [(False, None, None), (True, 20, 30.0)]
)
def test_xla_decode_items_across_iterations(monkeypatch, as_bytes, sliding_window, soft_cap):
    """Decode work items of 1 block, 3 per iteration: a row's items span several iterations,
    one iteration holds items of several rows (and several of one row), padding rows have none."""
    from jaxkv.pallas_kernels import tiles

    per_block = 8 * 2 * 2 * 64 * 4  # bs 8, K+V, Hkv 2, D 64, f32
    monkeypatch.setattr(tiles, "ITEM_KEYS", 8)
    monkeypatch.setattr(tiles, "CHUNK_BYTES", 3 * per_block)
    assert tiles.decode_items(2, 64, 4, 8, bound_blocks=37, num_rows=9) == (1, 3)
    assert tiles.decode_items(2, 64, 4, 8, bound_blocks=2, num_rows=1) == (1, 1)
    run_case(
        "xla",
        False,
        scenario="ragged",
        block_size=8,
        head_size=64,
        group=4,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        as_bytes=as_bytes,
    )


class TestXlaBytes(TestXla):
    """The XLA backend fed the byte view (``kv_dtype``) with an exact prefill-tile plan."""

    def check(self, **kw):
        run_case("xla", False, as_bytes=True, **kw)


@pytest.mark.skipif(ON_GPU, reason="the cpu backend's kernel is a CPU custom call")
class TestCpu(TestXla):
    """The "cpu" backend: prefill and decode rows on the C++ FFI kernel (f32 / bf16 / f16
    caches; fp8 caches run the XLA backend). Full grid, typed cache."""

    backend, interpret = "cpu", False

    def check(self, **kw):
        from jaxkv.pallas_kernels import cpu_backend

        if not cpu_backend.available():
            pytest.skip(f"CPU attention kernel unavailable: {cpu_backend.build_error()}")
        run_case(self.backend, self.interpret, **kw)

    @pytest.mark.parametrize(
        "cache_dtype,q_dtype", [("bfloat16", jnp.bfloat16), ("float16", jnp.float16)]
    )
    def test_half_caches_decode(self, cache_dtype, q_dtype):
        self.check(
            scenario="ragged",
            block_size=16,
            head_size=64,
            group=4,
            cache_dtype=cache_dtype,
            q_dtype=q_dtype,
            soft_cap=20.0,
        )

    @pytest.mark.parametrize(
        "head_size,group,cache_dtype",
        [(40, 4, "float32"), (72, 2, "bfloat16"), (80, 4, "float32"), (256, 16, "float32")],
    )
    def test_head_sizes(self, head_size, group, cache_dtype):
        """Head sizes off the vector kernels (40, 72: the portable loop), an odd multiple of 16
        (80) and the largest head with the largest group (256, 16)."""
        self.check(
            scenario="ragged",
            block_size=16,
            head_size=head_size,
            group=group,
            cache_dtype=cache_dtype,
            q_dtype=jnp.float32,
            sliding_window=70,
        )

    @pytest.mark.parametrize(
        "group,sliding_window,soft_cap,cache_dtype,q_dtype",
        [
            (1, None, None, "float32", jnp.float32),
            (4, 50, 20.0, "float32", jnp.float32),
            (8, 7, None, "bfloat16", jnp.bfloat16),
            (4, None, None, "float16", jnp.float32),
            (7, 30, None, "float32", jnp.float32),
            (6, None, 20.0, "bfloat16", jnp.float32),
            (3, None, None, "float32", jnp.float32),
            (3, 9, 20.0, "float16", jnp.float32),
        ],
    )
    def test_prefill_tiles(self, group, sliding_window, soft_cap, cache_dtype, q_dtype):
        """Chunks of several 32-row tiles (mid-sequence, windowed), a tile of one row, decodes.
        A group's heads go in blocks of 4, 3, 2 and 1 (7 = 4 + 3, 6 = 4 + 2, 3 = 3: SmolLM2's
        9 query / 3 KV heads); head size 80 is
        5 vectors of 16, one p.v register block of 4 and one of 1 when 4 heads go together."""
        self.check(
            scenario="chunked",
            block_size=16,
            head_size=80 if group >= 6 else 64,
            group=group,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            cache_dtype=cache_dtype,
            q_dtype=q_dtype,
        )

    @pytest.mark.parametrize(
        "block_size,sliding_window,soft_cap", [(16, None, None), (32, 200, 30.0)]
    )
    def test_long_decodes_in_parts(self, block_size, sliding_window, soft_cap):
        """~20k keys: the kernel splits its (row, head) items into parts taken by XLA's pool
        threads and the caller; chunks of 64 keys cross page borders."""
        self.check(
            scenario="long",
            block_size=block_size,
            head_size=64,
            group=4,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )


@pytest.mark.skipif(ON_GPU, reason="the cpu backend's kernel is a CPU custom call")
class TestCpuBytes(TestCpu):
    """The "cpu" backend on the byte view, as the engine calls it."""

    def check(self, **kw):
        super().check(as_bytes=True, **kw)


def _check_cpu_kernel_on_drawn_batch(
    data,
    *,
    block_sizes,
    head_sizes,
    groups,
    max_kv_len,
    max_seqs,
    max_q_vectors,
    cache_dtype,
    bf16_queries=False,
):
    """A drawn ragged batch (sequences of up to ``max_kv_len`` keys, query rows of up to
    ``max_q_vectors`` query vectors a KV head, windows, soft-caps): the "cpu" backend equals
    the reference within 2e-5; unused cache slots hold NaN, so a read past a row's keys fails.
    ``bf16_queries``: the queries' values rounded to bf16 (held in f32), as a bf16 model's."""
    from jaxkv.pallas_kernels import cpu_backend

    if not cpu_backend.available():
        pytest.skip(f"CPU attention kernel unavailable: {cpu_backend.build_error()}")
    bs = data.draw(st.sampled_from(block_sizes))
    head_size = data.draw(st.sampled_from(head_sizes))
    group = data.draw(st.sampled_from(groups))
    kv_lens = data.draw(st.lists(st.integers(1, max_kv_len), min_size=1, max_size=max_seqs))
    q_lens = [data.draw(st.integers(1, min(kl, max_q_vectors // group))) for kl in kv_lens]
    window = data.draw(st.one_of(st.none(), st.integers(1, 90)))
    soft_cap = data.draw(st.sampled_from([None, 15.0]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    b = make_batch(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        block_size=bs,
        num_q_heads=group * 2,
        num_kv_heads=2,
        head_size=head_size,
        cache_dtype=cache_dtype,
        num_seq_rows=len(q_lens) + 1,
        num_tokens=sum(q_lens) + 2,
        sliding_window=window,
    )
    args = list(b.attention_args())
    if bf16_queries:
        args[0] = args[0].astype(jnp.bfloat16).astype(jnp.float32)
        assert (np.asarray(args[0]).view(np.uint32) & 0xFFFF == 0).all()
    kw = dict(sm_scale=head_size**-0.5, sliding_window=window, soft_cap=soft_cap)
    want = np.asarray(pk.paged_attention(*args, backend="reference", **kw))
    got = np.asarray(pk.paged_attention(*args, backend="cpu", **kw))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(ON_GPU, reason="the cpu backend's kernel is a CPU custom call")
@settings(max_examples=15, deadline=None, derandomize=True)
@given(data=st.data())
def test_cpu_kernel_random_batches(data):
    """Random ragged batches (chunks anywhere in a sequence, decodes, tiles of 1..32+ rows),
    block sizes, head sizes on and off the vector kernels, windows and soft-caps vs the
    reference."""
    _check_cpu_kernel_on_drawn_batch(
        data,
        block_sizes=[4, 8, 16, 32],
        head_sizes=[16, 40, 64],
        groups=[1, 2, 3, 4],
        max_kv_len=160,
        max_seqs=5,
        max_q_vectors=10**6,
        cache_dtype="float32",
    )


@pytest.mark.skipif(ON_GPU, reason="the cpu backend's kernel is a CPU custom call")
@settings(max_examples=30, deadline=None, derandomize=True)
@given(data=st.data())
def test_cpu_kernel_decodes_bf16_queries_over_a_bf16_cache(data):
    """A bf16 model's decode: queries whose values are bf16 over a bf16 cache take q.k as bf16
    dot products on the cache's rows where the build has AVX512-BF16 (the scale on the
    logits), still within 2e-5 of the f32 reference. Head sizes off whole vectors of 32 (40)
    and scales that are not powers of two (40, 96); decode rows and a few speculative rows
    (under 16 query vectors a KV head)."""
    _check_cpu_kernel_on_drawn_batch(
        data,
        block_sizes=[8, 16, 32],
        head_sizes=[32, 40, 64, 96],
        groups=[1, 3, 4],
        max_kv_len=200,
        max_seqs=6,
        max_q_vectors=15,
        cache_dtype="bfloat16",
        bf16_queries=True,
    )


@pytest.mark.skipif(ON_GPU, reason="the cpu backend's kernel is a CPU custom call")
@settings(max_examples=20, deadline=None, derandomize=True)
@given(data=st.data())
def test_cpu_kernel_prefill_tiles_bf16_queries_over_a_bf16_cache(data):
    """A bf16 model's prefill: tiles (16 query vectors a KV head or more) of bf16 queries over
    a bf16 cache score keys with bf16 dot products on K transposed as pairs of bf16, still
    within 2e-5 of the f32 reference; chunked prompts, windows, soft-caps, head sizes on and
    off whole vectors of 32."""
    _check_cpu_kernel_on_drawn_batch(
        data,
        block_sizes=[8, 16, 32],
        head_sizes=[32, 40, 64, 96],
        groups=[1, 3, 4],
        max_kv_len=160,
        max_seqs=4,
        max_q_vectors=10**6,
        cache_dtype="bfloat16",
        bf16_queries=True,
    )


@pytest.mark.skipif(ON_GPU, reason="the cpu backend's kernel is a CPU custom call")
def test_cpu_kernel_sees_the_bf16_values_of_a_query_computed_in_the_same_jit():
    """A bf16 query computed inside the jit that attends (RoPE's multiply-add, which XLA:CPU
    fuses and computes in f32) reaches the kernel as its bf16 values: the result equals, bit
    for bit, the kernel's on the same query materialised as bf16 outside. XLA's excess
    precision would otherwise hand the kernel f32 values (and its f32 q.k path)."""
    from jaxkv.pallas_kernels import cpu_backend

    if not cpu_backend.available():
        pytest.skip(f"CPU attention kernel unavailable: {cpu_backend.build_error()}")
    rng = np.random.default_rng(0)
    b = make_batch(
        rng,
        q_lens=[40, 1, 1],
        kv_lens=[60, 90, 33],
        block_size=16,
        num_q_heads=6,
        num_kv_heads=2,
        head_size=64,
        cache_dtype="bfloat16",
    )
    q0, *rest = b.attention_args()
    x = q0.astype(jnp.bfloat16)
    c = jnp.asarray(rng.uniform(0.5, 1.5, x.shape), jnp.bfloat16)
    s = jnp.asarray(rng.uniform(-1.0, 1.0, x.shape), jnp.bfloat16)

    def attend(q):
        return pk.paged_attention(q, *rest, sm_scale=0.125, backend="cpu")

    fused = jax.jit(lambda x, c, s: attend(x * c + s * x))(x, c, s)
    q = jax.jit(lambda x, c, s: x * c + s * x)(x, c, s)
    assert q.dtype == jnp.bfloat16
    alone = jax.jit(attend)(q)
    np.testing.assert_array_equal(np.asarray(fused, np.float32), np.asarray(alone, np.float32))


def test_cpu_kernel_builds_where_a_compiler_exists():
    """A compiler on PATH means the kernel must build: a silent fallback would hide a broken
    build (CI machines have g++)."""
    import shutil

    from jaxkv.pallas_kernels import cpu_backend

    if ON_GPU or not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler / not a CPU run")
    assert cpu_backend.available(), cpu_backend.build_error()


@pytest.mark.skipif(
    not any(__import__("shutil").which(c) for c in ("c++", "g++")), reason="needs a C++ compiler"
)
def test_cpu_kernel_build_falls_back_to_flags_the_compiler_accepts(tmp_path, monkeypatch):
    """A compiler that rejects -march=native (Apple clang on arm64 did) and -fopenmp-simd still
    builds the kernels, with the next flag set; one that rejects everything reports its error."""
    import shutil
    import stat

    import jax

    from jaxkv.pallas_kernels import cpu_backend

    real = shutil.which("c++") or shutil.which("g++")
    picky = tmp_path / "picky-c++"
    picky.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in -march=native|-fopenmp-simd) '
        'echo "unsupported option $a" >&2; exit 1;; esac; done\n'
        f'exec {real} "$@"\n'
    )
    picky.chmod(picky.stat().st_mode | stat.S_IEXEC)
    # The small source only: the flag logic is what is tested, not the attention kernel.
    monkeypatch.setattr(cpu_backend, "SOURCES", (cpu_backend.SOURCES[0].parent / "kv_write.cc",))
    out = tmp_path / "k.so"
    flags, err = cpu_backend._compile(str(picky), jax.ffi.include_dir(), out)
    assert flags is not None, err
    assert "-march=native" not in flags and "-fopenmp-simd" not in flags
    assert flags[: len(cpu_backend.FLAGS)] == cpu_backend.FLAGS and out.stat().st_size > 0

    broken = tmp_path / "broken-c++"
    broken.write_text("#!/bin/sh\necho 'no such compiler really' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    flags, err = cpu_backend._compile(str(broken), jax.ffi.include_dir(), tmp_path / "never.so")
    assert flags is None and "no such compiler really" in err
    assert not (tmp_path / "never.so").exists() and list(tmp_path.glob("*.so")) == [out]


def _subset(cases, keep):
    return [c for i, c in enumerate(cases) if i in keep]


class TestPallas(TestXla):
    """The Pallas kernel: compiled on GPU (whole grid), interpret mode on CPU (a subset)."""

    backend, interpret = "pallas", not ON_GPU

    def check(self, **kw):
        # Interpret mode runs every program in Python-driven XLA: keep CPU cases few.
        run_case(self.backend, self.interpret, **kw)

    if not ON_GPU:

        @pytest.mark.parametrize("block_size,head_size,group", _subset(GRID, {0, 5, 7}))
        def test_mixed_grid(self, block_size, head_size, group):
            self.check(scenario="mixed", block_size=block_size, head_size=head_size, group=group)

        @pytest.mark.parametrize(
            "sliding_window,soft_cap,cache_dtype,q_dtype,fp8_scale", _subset(FEATURES, {2, 5})
        )
        def test_features(self, sliding_window, soft_cap, cache_dtype, q_dtype, fp8_scale):
            super().test_features(sliding_window, soft_cap, cache_dtype, q_dtype, fp8_scale)

        @pytest.mark.parametrize("sliding_window,cache_dtype,fp8_scale", [(6, "float32", None)])
        def test_decode_features(self, sliding_window, cache_dtype, fp8_scale):
            super().test_decode_features(sliding_window, cache_dtype, fp8_scale)

        @pytest.mark.parametrize("max_q_len", [None])
        def test_wide_table_and_loose_max_q_len(self, max_q_len):
            super().test_wide_table_and_loose_max_q_len(max_q_len)

        @pytest.mark.skip(reason="covered by the other interpret cases; runs on GPU")
        def test_no_padding(self):
            pass


def test_invalid_args_raise_value_error():
    b = make_batch(
        np.random.default_rng(0),
        q_lens=[1],
        kv_lens=[3],
        block_size=8,
        num_q_heads=4,
        num_kv_heads=2,
        head_size=64,
    )
    q, kv, sl, qsl, bt, ns = b.attention_args()
    call = functools.partial(pk.paged_attention, sm_scale=0.1)
    bad = [
        (dict(backend="cuda"), "backend"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(soft_cap=-1.0), "soft_cap"),
        (dict(k_scale=0.5), "k_scale"),
        (dict(max_q_len=-1), "max_q_len"),
        (dict(sm_scale=float("nan")), "sm_scale"),
    ]
    for kw, name in bad:
        with pytest.raises(ValueError, match=name):
            call(q, kv, sl, qsl, bt, ns, **kw)
    with pytest.raises(ValueError, match="num_q_heads"):
        call(q[:, :3], kv, sl, qsl, bt, ns)
    with pytest.raises(ValueError, match="query_start_loc"):
        call(q, kv, sl, qsl[:1], bt, ns)
    with pytest.raises(ValueError, match="head size"):
        call(q[..., :32], kv, sl, qsl, bt, ns)
    with pytest.raises(ValueError, match="sm_scale"):
        pk.paged_attention_reference(q, kv, sl, qsl, bt, ns, sm_scale=-1.0)
