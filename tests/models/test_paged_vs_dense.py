"""Paged forward == dense forward, for both families, through a hand-driven mini engine.

``MiniEngine`` plays the scheduler and the worker in a few lines: one shared pool of block ids
handed out in a random order (block 0 never), block tables per KV-cache group, slot mappings
computed from them, sliding-window groups that free the blocks no query can see any more
(and NaN-fill them, as garbage from a previous owner), and KV buffers that start NaN-filled so
any read of an unwritten slot poisons the output. Every scheduled token's logits are checked
against ``dense_forward`` of the full sequence.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.models import KVCacheBinding, build_model, dense_forward, get_config, layer_name
from jaxkv.pallas_kernels import NULL_BLOCK_ID, PAD_SLOT_ID, AttentionMetadata, page_bytes

BLOCK_SIZE = 4
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def slot_mapping_from_block_table(
    block_table: np.ndarray,  # [B] int32, one sequence's row
    positions: np.ndarray,  # [n] int32
    block_size: int,
) -> np.ndarray:  # [n] int32
    """slot = block_table[pos // bs] * bs + pos % bs.

    Example (bs 4): table [7, 3], positions [5, 6] -> [13, 14].
    """
    return (block_table[positions // block_size] * block_size + positions % block_size).astype(
        np.int32
    )


@dataclasses.dataclass
class _Seq:
    tokens: np.ndarray  # [L] the whole sequence (prompt + tokens fed as decodes)
    computed: int = 0
    tables: list = None  # per group: list of block ids (NULL_BLOCK_ID = freed)


class MiniEngine:
    """Groups are lists of layer indices; tensor j is shared by layer j of every group."""

    def __init__(
        self,
        model,
        groups: list[list[int]],
        *,
        num_blocks: int,
        num_tokens: int,
        max_seqs: int,
        max_blocks: int,
        backend: str = "xla",
        seed: int = 0,
    ):
        cache_dtype = model.config.dtype  # the cache holds exactly what the dense path sees
        c = model.config
        self.model, self.groups, self.num_tokens, self.max_seqs, self.max_blocks = (
            model,
            groups,
            num_tokens,
            max_seqs,
            max_blocks,
        )
        self.windows = [c.layer_window(g[0]) for g in groups]
        assert all(c.layer_window(i) == w for g, w in zip(groups, self.windows) for i in g)
        self.binding = KVCacheBinding(
            layers=tuple(
                (layer_name(i), gi, j) for gi, g in enumerate(groups) for j, i in enumerate(g)
            ),
            block_size=BLOCK_SIZE,
            cache_dtype=cache_dtype,
            backend=backend,
        )
        self.page_bytes = page_bytes(BLOCK_SIZE, c.num_key_value_heads, c.head_dim, cache_dtype)
        np_dtype = np.dtype(jnp.dtype(cache_dtype))
        nan_page = np.full(self.page_bytes // np_dtype.itemsize, np.nan, np_dtype).view(np.uint8)
        self.nan_page = nan_page
        num_tensors = max(len(g) for g in groups)
        self.buffers = tuple(jnp.asarray(np.tile(nan_page, num_blocks)) for _ in range(num_tensors))
        self.free = list(np.random.RandomState(seed).permutation(np.arange(1, num_blocks)))
        graphdef, state = nnx.split(model)
        self.state = state

        @functools.partial(jax.jit, static_argnames=("binding",), donate_argnames=("kv_buffers",))
        def step(state, input_ids, positions, kv_buffers, attn_metadata, binding):
            m = nnx.merge(graphdef, state)
            hidden, kv_buffers = m(input_ids, positions, kv_buffers, attn_metadata, binding)
            return m.compute_logits(hidden), kv_buffers

        self._step = step

    def add(self, tokens: np.ndarray) -> _Seq:
        return _Seq(np.asarray(tokens, np.int32), 0, [[] for _ in self.groups])

    def _free_out_of_window(self, seq: _Seq, g: int) -> None:
        """vLLM's sliding-window manager: blocks wholly before (first query pos - W + 1) go back."""
        window = self.windows[g]
        if window is None:
            return
        first_needed = seq.computed - window + 1
        for j, b in enumerate(seq.tables[g]):
            if b != NULL_BLOCK_ID and (j + 1) * BLOCK_SIZE <= first_needed:
                seq.tables[g][j] = NULL_BLOCK_ID
                self.free.append(b)
                self._poison(b)

    def _poison(self, block: int) -> None:
        lo = block * self.page_bytes
        self.buffers = tuple(
            buf.at[lo : lo + self.page_bytes].set(jnp.asarray(self.nan_page))
            for buf in self.buffers
        )

    def step(self, scheduled: list[tuple[_Seq, int]], max_q_len: int = 0) -> list[np.ndarray]:
        """Runs one step; returns per scheduled sequence the logits [n, V] of its new tokens."""
        T, S, B = self.num_tokens, self.max_seqs, self.max_blocks
        ids = np.zeros(T, np.int32)
        pos = np.zeros(T, np.int32)
        qsl = np.zeros(S + 1, np.int32)
        seq_lens = np.zeros(S, np.int32)
        tables = np.full((len(self.groups), S, B), NULL_BLOCK_ID, np.int32)
        slots = np.full((len(self.groups), T), PAD_SLOT_ID, np.int32)
        t = 0
        for row, (seq, n) in enumerate(scheduled):
            new_len = seq.computed + n
            p = np.arange(seq.computed, new_len, dtype=np.int32)
            ids[t : t + n], pos[t : t + n] = seq.tokens[seq.computed : new_len], p
            for g in range(len(self.groups)):
                self._free_out_of_window(seq, g)
                while len(seq.tables[g]) * BLOCK_SIZE < new_len:
                    seq.tables[g].append(self.free.pop(0))
                tables[g, row, : len(seq.tables[g])] = seq.tables[g]
                slots[g, t : t + n] = slot_mapping_from_block_table(tables[g, row], p, BLOCK_SIZE)
            seq_lens[row] = new_len
            t += n
            qsl[row + 1] = t
        qsl[len(scheduled) + 1 :] = t
        md = tuple(
            AttentionMetadata(
                seq_lens=jnp.asarray(seq_lens),
                query_start_loc=jnp.asarray(qsl),
                block_tables=jnp.asarray(tables[g]),
                slot_mapping=jnp.asarray(slots[g]),
                num_seqs=jnp.asarray(len(scheduled), jnp.int32),
                max_q_len=max_q_len,
            )
            for g in range(len(self.groups))
        )
        logits, self.buffers = self._step(
            self.state, jnp.asarray(ids), jnp.asarray(pos), self.buffers, md, binding=self.binding
        )
        logits = np.asarray(logits)
        out, t = [], 0
        for seq, n in scheduled:
            out.append(logits[t : t + n])
            seq.computed += n
            t += n
        return out


def _check_steps(
    engine: MiniEngine,
    seqs: list[_Seq],
    schedule: list[list[tuple[int, int]]],
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> None:
    lengths = [len(s.tokens) for s in seqs]
    padded = np.zeros((len(seqs), max(lengths)), np.int32)
    for i, s in enumerate(seqs):
        padded[i, : lengths[i]] = s.tokens
    dense = np.asarray(nnx.jit(dense_forward)(engine.model, jnp.asarray(padded)))
    for k, step in enumerate(schedule):
        decode_only = all(n == 1 for _, n in step)
        max_q = 1 if decode_only and k % 2 else 0  # both the pure-decode bound and "unknown"
        got = engine.step([(seqs[i], n) for i, n in step], max_q_len=max_q)
        for (i, n), g in zip(step, got):
            start = seqs[i].computed - n
            want = dense[i, start : start + n]
            assert np.isfinite(g).all(), (
                f"step {k} seq {i}: non-finite logits (read an unwritten page?)"
            )
            np.testing.assert_allclose(
                g,
                want,
                atol=atol,
                rtol=rtol,
                err_msg=f"step {k}, seq {i}, positions {start}..{start + n - 1}",
            )


# Sequence lengths 34, 13, 21. Steps mix chunked prefill (seq 0 in 3 chunks), a late arrival
# (seq 2 at step 1), decodes, and a step with one padding sequence row.
_LENGTHS = (34, 13, 21)
_SCHEDULE = [
    [(0, 12), (1, 7)],
    [(0, 12), (1, 1), (2, 10)],
    [(0, 6), (1, 1), (2, 9)],
    [(0, 1), (1, 1), (2, 1)],
    [(0, 1), (2, 1), (1, 1)],
    [(0, 1), (1, 1)],
    [(0, 1), (1, 1)],
]

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
_CASES = {
    # Llama 3: GQA, llama3 rope scaling, untied head.
    "llama3": dict(name="tiny-llama", num_hidden_layers=2, rope_scaling=_LLAMA3_ROPE),
    # Qwen3-style: per-head q/k norm, biases, tied embeddings.
    "qwen": dict(
        name="tiny-llama",
        num_hidden_layers=2,
        qk_norm=True,
        attention_bias=True,
        attention_out_bias=True,
        tie_word_embeddings=True,
    ),
    # Mistral-style: one sliding-window group; out-of-window blocks are freed and reused.
    "mistral": dict(name="tiny-llama", num_hidden_layers=2, sliding_window=6),
    # bfloat16 parameters, activations and cache.
    "llama-bf16": dict(name="tiny-llama", num_hidden_layers=2, dtype="bfloat16"),
    # Gemma 2: two groups (full = odd layers, sliding = even layers) sharing the tensors.
    "gemma2": dict(name="tiny-hybrid", sliding_window=6),
}


def _groups(config) -> list[list[int]]:
    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
    return [g for g in (full, sliding) if g]


def _randomize_biases(model, seed: int) -> None:
    """Zero-initialised biases and norms would hide mistakes; give them random values."""
    rng = np.random.RandomState(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] in ("bias", "weight"):
            var[...] = var[...] + jnp.asarray(0.1 * rng.randn(*var[...].shape), var[...].dtype)


@pytest.mark.parametrize("case", sorted(_CASES))
def test_paged_forward_matches_dense(case):
    kw = dict(_CASES[case])
    config = get_config(kw.pop("name"), **{**SMALL, **kw})
    model = build_model(config, seed=1)
    _randomize_biases(model, seed=2)
    groups = _groups(config)
    if case == "gemma2":
        assert groups == [[1, 3], [0, 2]]
    engine = MiniEngine(
        model, groups, num_blocks=48, num_tokens=24, max_seqs=4, max_blocks=10, seed=3
    )
    rng = np.random.RandomState(4)
    seqs = [engine.add(rng.randint(0, config.vocab_size, n)) for n in _LENGTHS]
    # bf16: XLA may keep excess precision differently in the two jitted programs (~0.04 here).
    atol, rtol = (0.1, 0.05) if config.dtype == "bfloat16" else (1e-4, 1e-4)
    with jax.default_matmul_precision("float32"):
        _check_steps(engine, seqs, _SCHEDULE, atol=atol, rtol=rtol)
    if config.sliding_window is not None:
        assert NULL_BLOCK_ID in seqs[0].tables[-1], (
            "the sliding group freed no block: window unused"
        )


def test_paged_forward_reference_backend_hybrid():
    config = get_config("tiny-hybrid", **{**SMALL, "num_hidden_layers": 2, "sliding_window": 5})
    model = build_model(config, seed=5)
    engine = MiniEngine(
        model,
        _groups(config),
        num_blocks=16,
        num_tokens=12,
        max_seqs=2,
        max_blocks=4,
        backend="reference",
        seed=6,
    )
    rng = np.random.RandomState(7)
    seqs = [engine.add(rng.randint(0, config.vocab_size, n)) for n in (11, 6)]
    with jax.default_matmul_precision("float32"):
        _check_steps(engine, seqs, [[(0, 7), (1, 5)], [(0, 4), (1, 1)]])


def test_dense_forward_refuses_positions_past_max_position_embeddings():
    """RoPE's tables cover [0, max_position_embeddings): a longer dense forward is an error,
    not a silently clamped rotation."""
    model = build_model(get_config("tiny-llama", **SMALL, max_position_embeddings=8), seed=0)
    assert dense_forward(model, jnp.ones((1, 8), jnp.int32)).shape == (1, 8, 256)
    with pytest.raises(ValueError, match="length 9 exceeds the model's max_position_embeddings 8"):
        dense_forward(model, jnp.ones((1, 9), jnp.int32))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid"])
def test_vocab_major_logits_are_the_transpose(name):
    """compute_logits(vocab_major=True) (W @ h^T, the greedy step's LM head) is the transpose of
    the row-major logits: untied head (llama) and tied embedding + final soft-cap (hybrid)."""
    model = build_model(get_config(name, **SMALL), seed=2)
    h = jax.random.normal(jax.random.PRNGKey(0), (5, SMALL["hidden_size"]), jnp.float32)
    rows = model.compute_logits(h)
    cols = model.compute_logits(h, vocab_major=True)
    assert rows.shape == (5, 256) and cols.shape == (256, 5) and cols.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(cols), np.asarray(rows).T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="hidden \\[R, hidden\\]"):
        model.compute_logits(h[None], vocab_major=True)


@pytest.mark.parametrize("rows", [5, 40])
def test_bf16_head_sums_in_f32(rows):
    """A bf16 LM head (on the CPU: the C++ kernel at 5 rows, XLA's bf16 dot at 40): the logits
    are the f32 sums of the same bf16 numbers, not rounded to bf16, in both orientations."""
    model = build_model(get_config("tiny-llama", **SMALL, dtype="bfloat16"), seed=2)
    w = model.lm_head.weight[...]
    assert w.dtype == jnp.bfloat16
    h = jax.random.normal(jax.random.PRNGKey(1), (rows, SMALL["hidden_size"]), jnp.bfloat16)
    want = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
    got = np.asarray(model.compute_logits(h))
    cols = np.asarray(model.compute_logits(h, vocab_major=True))
    assert got.dtype == np.float32 and cols.shape == (256, rows)
    tol = 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    np.testing.assert_allclose(cols, want.T, rtol=0, atol=tol)
