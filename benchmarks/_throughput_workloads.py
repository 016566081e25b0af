"""The throughput benchmark's seeded synthetic workloads and its model loading.

Used by ``throughput.py`` and by the benchmarks that run the same requests or models
(``serve.py``, ``async_ab.py``, ``embed_throughput.py``, ``spec_decode.py``).
"""

from __future__ import annotations

import dataclasses

import engine_harness as eh
import numpy as np


@dataclasses.dataclass(frozen=True)
class Sizes:
    fixed_n: int = 64
    fixed_prompt: tuple = (32, 256)
    fixed_out: int = 64
    mixed_n: int = 256
    mixed_prompt: tuple = (32, 512)
    mixed_out: tuple = (16, 256)
    shared_n: int = 64
    shared_len: int = 1024
    shared_private: tuple = (32, 128)
    shared_out: int = 64
    contexts: tuple = (1024, 2048, 4096, 8192, 16384)
    decode_batches: tuple = (1, 16)
    decode_steps: int = 16
    kv_compare_context: int = 4096


FULL = Sizes()
QUICK = Sizes(
    fixed_n=32,
    fixed_prompt=(32, 128),
    fixed_out=32,
    mixed_n=64,
    mixed_prompt=(32, 256),
    mixed_out=(8, 64),
    shared_n=16,
    shared_len=256,
    shared_private=(16, 64),
    shared_out=16,
    contexts=(1024, 2048),
    decode_steps=6,
    kv_compare_context=1024,
)
WORKLOADS = ("fixed", "mixed", "shared-prefix", "long-decode")


def make_requests(name: str, sz: Sizes, vocab: int, seed: int) -> tuple[list, list, dict]:
    """(prompts, output lengths, description) of workload ``name`` (not long-decode)."""
    rng = np.random.default_rng(seed)
    if name == "fixed":
        lens = rng.integers(sz.fixed_prompt[0], sz.fixed_prompt[1] + 1, sz.fixed_n)
        prompts = [eh.seeded_tokens(rng, int(n), vocab) for n in lens]
        outs = [sz.fixed_out] * sz.fixed_n
        desc = dict(
            requests=sz.fixed_n, prompt_len=f"U{list(sz.fixed_prompt)}", output_len=sz.fixed_out
        )
    elif name == "mixed":
        lens = rng.integers(sz.mixed_prompt[0], sz.mixed_prompt[1] + 1, sz.mixed_n)
        prompts = [eh.seeded_tokens(rng, int(n), vocab) for n in lens]
        outs = rng.integers(sz.mixed_out[0], sz.mixed_out[1] + 1, sz.mixed_n).tolist()
        desc = dict(
            requests=sz.mixed_n,
            prompt_len=f"U{list(sz.mixed_prompt)}",
            output_len=f"U{list(sz.mixed_out)}",
        )
    elif name == "shared-prefix":
        shared = eh.seeded_tokens(rng, sz.shared_len, vocab)
        lens = rng.integers(sz.shared_private[0], sz.shared_private[1] + 1, sz.shared_n)
        prompts = [shared + eh.seeded_tokens(rng, int(n), vocab) for n in lens]
        outs = [sz.shared_out] * sz.shared_n
        desc = dict(
            requests=sz.shared_n,
            shared_prefix=sz.shared_len,
            private_len=f"U{list(sz.shared_private)}",
            output_len=sz.shared_out,
        )
    else:
        raise ValueError(name)
    desc.update(seed=seed, sampling="greedy, ignore_eos")
    return prompts, [int(o) for o in outs], desc


def sizes_from(quick: bool, overrides: str | None) -> Sizes:
    """QUICK or FULL with ``--sizes`` overrides applied (a single int for a tuple field: (int,))."""
    sz = QUICK if quick else FULL
    kw = kv_pairs(overrides)
    for k, v in kw.items():
        if isinstance(getattr(sz, k), tuple) and isinstance(v, int):
            kw[k] = (v,)
    return dataclasses.replace(sz, **kw)


def load_model(name: str, seed: int, max_pos: int | None = None, overrides: dict | None = None):
    """(model, tokenizer). Random-init configs take ``overrides`` (``--model-config``) and get
    ``max_position_embeddings >= max_pos`` (positions do not change the weights: same seed,
    same parameters)."""
    from jaxkv.models import build_model, get_config
    from jaxkv.models import load_model as _load
    from jaxkv.models.registry import RANDOM_INIT_NAMES

    if name in RANDOM_INIT_NAMES and (max_pos or overrides):
        cfg = get_config(name, **(overrides or {}))
        cfg = dataclasses.replace(
            cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_pos or 0)
        )
        return build_model(cfg, seed=seed), None
    if overrides:
        raise ValueError(f"--model-config applies to random-init models only, not {name!r}")
    model, _, tok = _load(name, seed=seed)
    return model, tok


def kv_pairs(text: str | None) -> dict:
    """'a=1,b=2:3' -> {'a': 1, 'b': (2, 3)} (ints; ':' separates tuple items)."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        k, v = item.split("=")
        out[k.strip()] = tuple(int(x) for x in v.split(":")) if ":" in v else int(v)
    return out
