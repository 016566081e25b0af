"""Helpers for the checkpoint tests: a tiny byte-level BPE vocabulary and a GGUF writer that
follows llama.cpp's converter (names, q/k row permutation, tokenizer metadata)."""

from __future__ import annotations

import numpy as np
from tokenizers import pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [
    "h e",
    "l l",
    "l o",
    "Ġ t",
    "Ġt he",
    "e ll",
    "h ell",
    "hell o",
    "Ġ w",
    "o r",
    "Ġw or",
    "1 2",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def bpe_vocab() -> tuple[list[str], list[int]]:
    """(tokens in id order, GGUF token types): specials first (type 3), then the 256 byte
    symbols and the merge results (type 1)."""
    tokens = list(SPECIALS) + sorted(pre_tokenizers.ByteLevel.alphabet())
    for merge in MERGES:
        merged = merge.replace(" ", "")
        if merged not in tokens:
            tokens.append(merged)
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


def gguf_permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (the file-format fact being tested):
    per head, rows [first half | second half] -> interleaved pairs."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def hf_to_gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, idx, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{idx}.{HF_TO_GGUF_BLOCK[module]}.{suffix}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[name]


def write_llama_gguf(
    path,
    hf_config: dict,
    tensors: dict[str, np.ndarray],
    *,
    quantize: dict[str, object] | None = None,
    raw: dict[str, tuple[object, np.ndarray]] | None = None,
    pre: str = "smollm",
    add_bos: bool = False,
    with_tokenizer: bool = True,
) -> None:
    """Writes a llama-architecture GGUF the way llama.cpp's converter does.

    ``quantize`` maps HF tensor names to a `gguf.GGMLQuantizationType` (default F32).
    ``raw`` maps HF tensor names to ``(type, encoded rows [out, bytes] uint8)`` written as
    they are (types gguf-py cannot quantize, e.g. Q4_K); their ``tensors`` entry only names
    them (q/k rows are permuted as llama.cpp's converter does).
    """
    import gguf

    quantize = quantize or {}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(hf_config["num_hidden_layers"])
    w.add_context_length(hf_config["max_position_embeddings"])
    w.add_embedding_length(hf_config["hidden_size"])
    w.add_feed_forward_length(hf_config["intermediate_size"])
    w.add_head_count(hf_config["num_attention_heads"])
    w.add_head_count_kv(hf_config["num_key_value_heads"])
    w.add_rope_freq_base(hf_config["rope_theta"])
    w.add_layer_norm_rms_eps(hf_config["rms_norm_eps"])
    if with_tokenizer:
        tokens, types = bpe_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(add_bos)
        w.add_chat_template(CHAT_TEMPLATE)
    heads = {"q_proj": hf_config["num_attention_heads"], "k_proj": hf_config["num_key_value_heads"]}
    raw = raw or {}
    for name, value in tensors.items():
        proj = name.split(".")[-2]
        if name in raw:
            qtype, data = raw[name]
            data = gguf_permute_rows(data, heads[proj]) if proj in heads else data
            w.add_tensor(hf_to_gguf_name(name), data, raw_dtype=qtype)
            continue
        value = np.asarray(value, dtype=np.float32)
        if proj in heads:
            value = gguf_permute_rows(value, heads[proj])
        qtype = quantize.get(name, gguf.GGMLQuantizationType.F32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(hf_to_gguf_name(name), value)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(hf_to_gguf_name(name), value.astype(np.float16))
        else:
            data = gguf.quants.quantize(value, qtype)
            w.add_tensor(hf_to_gguf_name(name), data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def small_config(name: str = "tiny-llama", **overrides):
    """A few-layer version of a named tiny config (fast on CPU; dims fit GGUF's 32-blocks)."""
    from jaxkv.models import get_config

    kw = dict(
        vocab_size=288,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    if name == "tiny-hybrid":
        kw.update(sliding_window=4, query_pre_attn_scalar=16.0)
    kw.update(overrides)
    return get_config(name, **kw)


def hf_config_dict(config) -> dict:
    """The HF config.json a transformers checkpoint of ``config`` would carry."""
    d = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        hidden_act=config.hidden_act,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
    )
    if config.architecture == "gemma2":
        d.update(
            model_type="gemma2",
            architectures=["Gemma2ForCausalLM"],
            sliding_window=config.sliding_window,
            attn_logit_softcapping=config.attn_logit_softcapping,
            final_logit_softcapping=config.final_logit_softcapping,
            query_pre_attn_scalar=config.query_pre_attn_scalar,
        )
    else:
        d.update(model_type="llama", architectures=["LlamaForCausalLM"])
    return d
