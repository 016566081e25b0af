"""The throughput benchmark's FLOP model: useful model FLOPs of a request, and XLA's FLOP/s
on the model's own matmul chain (the ceiling for MFU with XLA's dots)."""

from __future__ import annotations

import bench_common as bc

FLOPS_FORMULA = (
    "model FLOPs = 2 * P_nonembed * computed_tokens + 2 * hidden * vocab * output_tokens "
    "(LM head, one row per sampled token) + 4 * layers * q_heads * head_dim * sum(context "
    "of each computed token); computed_tokens = prompt - prefix_hit + output - 1"
)


def nonembed_params(cfg) -> int:
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * cfg.num_attention_heads * d * 2 + h * cfg.num_key_value_heads * d * 2
    return cfg.num_hidden_layers * (attn + 3 * h * cfg.intermediate_size)


def request_flops(cfg, prompt_len: int, output_len: int, cached: int = 0) -> float:
    """Useful model FLOPs of one request (see FLOPS_FORMULA)."""
    first, last = cached, prompt_len + output_len - 2  # positions computed (inclusive)
    tokens = max(0, last - first + 1)
    ctx_sum = (last + 1) * (last + 2) // 2 - first * (first + 1) // 2  # sum of (p + 1)
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * ctx_sum
    return (
        2.0 * nonembed_params(cfg) * tokens
        + 2.0 * cfg.hidden_size * cfg.vocab_size * output_len
        + attn
    )


def model_matmuls(cfg, decode_rows: int, prefill_rows: int | None, peak: float) -> dict | None:
    """XLA's FLOP/s on the model's own matmul chain at a decode step's and a prefill step's
    rows (``bench_common.model_matmul_flops``): the ceiling for MFU with XLA's dots here.
    Skipped for models whose fp32 weights would not fit comfortably (> 2 GiB)."""
    weight_bytes = 4 * (nonembed_params(cfg) + cfg.hidden_size * cfg.vocab_size)
    if weight_bytes > 2 * 2**30 or not prefill_rows:
        return None
    out = {
        "decode": bc.model_matmul_flops(cfg, decode_rows, lm_head=True),
        "prefill": bc.model_matmul_flops(cfg, prefill_rows, lm_head=False),
    }
    for r in out.values():
        r["pct_of_matmul_probe"] = 100.0 * r["flops_per_s"] / peak
    return out
