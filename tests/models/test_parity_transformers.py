"""Parity with HF transformers on random-weight checkpoints saved by transformers itself.

Needs torch and transformers (the ``parity`` extra; on the CI machines ``pip install
torch==2.13.0`` takes a local CPU wheel first); skipped when either is absent.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxkv.models import dense_forward  # noqa: E402
from jaxkv.models.registry import load_model  # noqa: E402

pytestmark = pytest.mark.parity

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    initializer_range=0.1,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False
    ),
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON,
        sliding_window=8,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    # one local layer (RoPE base 10^4, window 4) and one global (base 10^6), q/k norms
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **COMMON,
        sliding_window=4,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
}
PROMPT = [[3, 17, 101, 45, 9, 200, 33, 7, 64, 12, 5, 250]]  # [1, 12]; longer than the window
STEPS = 32


@pytest.fixture(params=sorted(CONFIGS))
def checkpoint(request, tmp_path):
    if request.param == "gemma3" and not hasattr(transformers, "Gemma3TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 3 (4.50+)")
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():  # Gemma's (1 + weight) norms start at 0: make each one matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model, tmp_path


def test_logits_and_greedy_tokens_match(checkpoint):
    hf_model, path = checkpoint
    model, config, _ = load_model(path)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        want = hf_model(ids).logits.numpy()
    got = np.asarray(dense_forward(model, jnp.asarray(PROMPT, jnp.int32)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    with torch.no_grad():
        hf_tokens = hf_model.generate(
            ids,
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPT[0]) :].tolist()
    # Causal attention: right-padding to one fixed length changes no logit and compiles once.
    forward = jax.jit(dense_forward)
    n = len(PROMPT[0])
    seq = np.zeros((1, n + STEPS), np.int32)
    seq[0, :n] = PROMPT[0]
    for t in range(n, n + STEPS):
        seq[0, t] = int(jnp.argmax(forward(model, jnp.asarray(seq))[0, t - 1]))
    assert seq[0, n:].tolist() == hf_tokens


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_on_the_same_weights():
    """The dequantized SmolLM2 GGUF, loaded by transformers and by jaxkv, gives the same greedy
    tokens: an independent check of the q/k un-permutation and of the name mapping."""
    from jaxkv.models.checkpoint import read_gguf, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 download failed: {e}")
    hf_config, tensors, tok, _ = read_gguf(path)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config)).eval()
    state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in tensors.items()}
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    assert list(missing) == ["lm_head.weight"] and not unexpected  # tied to the embedding
    model, _, _ = load_model(path)
    prompt = tok.encode("def fibonacci(n):")
    with torch.no_grad():
        hf_tokens = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )[0, len(prompt) :].tolist()
    forward = jax.jit(dense_forward)
    seq = np.zeros((1, len(prompt) + 8), np.int32)
    seq[0, : len(prompt)] = prompt
    for t in range(len(prompt), seq.shape[1]):
        seq[0, t] = int(jnp.argmax(forward(model, jnp.asarray(seq))[0, t - 1]))
    assert seq[0, len(prompt) :].tolist() == hf_tokens
