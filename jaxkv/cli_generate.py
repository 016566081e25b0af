"""``jaxkv generate``: the README's main job (SmolLM2-135M-Instruct on the CPU by default)."""

from __future__ import annotations

import sys
import time

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
    "List three prime numbers.",
)


def add_parser(sub) -> None:
    from jaxkv.cli import parse_bytes, parse_ngram

    p = sub.add_parser("generate", help="generate completions (default: SmolLM2-135M-Instruct on CPU)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="smollm2-135m-instruct | tiny-llama | tiny-hybrid | HF dir | .gguf file")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in prompts")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache budget, e.g. 256MiB (default: 512MiB on CPU, 90%% of free memory on GPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests per step (vLLM's --max-num-seqs)")
    p.add_argument("--attention-backend", default="auto", help="auto | xla | cpu | pallas | reference")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule step N+1 while step N runs (same tokens; pays on GPU / TPU)")
    p.add_argument("--speculative-ngram", type=parse_ngram, default=None, metavar="K[,MAX[,MIN]]",
                   help="draft K tokens a step by n-gram lookup (MAX..MIN, default 4..1) over each "
                        "request's tokens")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N devices (on CPU: N host devices, set up here)")
    p.add_argument("--beam-width", type=int, default=None, metavar="N",
                   help="beam search (vLLM's LLM.beam_search) with N beams instead of sampling")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    if args.tensor_parallel_size > 1:
        _host_devices(args.tensor_parallel_size)
    from jaxkv.llm import LLM
    from jaxkv.sampling_params import SamplingParams

    beam = None
    if args.beam_width is not None:   # checked before the model loads
        from jaxkv.beam_search import BeamSearchParams
        try:
            beam = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens)
        except (ValueError, TypeError) as e:
            print(f"jaxkv generate: {e}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    try:
        llm = LLM(args.model, kv_cache_memory_bytes=args.kv_cache_memory, block_size=args.block_size,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  attention_backend=args.attention_backend,
                  seed=args.seed, async_scheduling=args.async_scheduling, verbose=True,
                  speculative_config=args.speculative_ngram,
                  tensor_parallel_size=args.tensor_parallel_size)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"jaxkv generate: {e}", file=sys.stderr)
        return 2
    engine = llm.llm_engine
    load_s = time.perf_counter() - t0
    tok = engine.tokenizer
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    if tok is None:  # random-weight models have no tokenizer: use token ids
        prompts = [[(7 * i + 3 * j) % (engine.model_config.vocab_size - 3) + 3 for j in range(8 + 4 * i)]
                   for i in range(len(prompts))]
    elif not args.no_chat and tok.chat_template:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    if beam is not None:
        return _beam_search(llm, args, beam, prompts, load_s)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed if args.temperature > 0 else None)
    c0, cs0 = engine.runner.num_compiles, engine.runner.compile_seconds   # warm-up's are in load
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    for i, o in enumerate(outs):
        shown = (args.prompt or DEFAULT_PROMPTS)[i] if tok is not None else f"{len(o.prompt_token_ids)} token ids"
        c = o.outputs[0]
        text = c.text if tok is not None else " ".join(map(str, c.token_ids))
        print(f"--- [{i}] {shown}\n{text.strip()}\n    ({len(c.token_ids)} tokens, finish: {c.finish_reason})")
    stats = engine.get_stats()
    num_blocks = engine.kv_cache_config.num_blocks
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    tp = f" x {args.tensor_parallel_size} (tensor parallel)" if args.tensor_parallel_size > 1 else ""
    print(f"\nmodel {args.model} on {engine.runner.backend} ({_device()}{tp}), load {load_s:.1f} s")
    print(f"{n_out} tokens in {gen_s:.2f} s = {n_out / gen_s:.1f} tok/s "
          f"(includes {stats['num_compiles'] - c0} compiles, {stats['compile_seconds'] - cs0:.1f} s; "
          f"load includes {c0} warm-up compiles)")
    print(f"KV cache: {num_blocks} blocks of {engine.config.block_size} tokens, peak use "
          f"{stats['peak_kv_cache_usage'] * 100:.1f}% ({round(stats['peak_kv_cache_usage'] * (num_blocks - 1))} blocks); "
          f"prefix-cache hits {stats['prefix_hit_tokens']} tokens; preemptions {stats['num_preemptions']}")
    if "spec_num_draft_tokens" in stats:
        print(f"speculative: {stats['spec_num_accepted_tokens']} of {stats['spec_num_draft_tokens']} "
              f"drafts accepted ({stats['spec_acceptance_rate'] * 100:.0f}%)")
    return 0


def _beam_search(llm, args, params, prompts, load_s: float) -> int:
    engine = llm.llm_engine
    tok = engine.tokenizer
    c0 = engine.runner.num_compiles
    t1 = time.perf_counter()
    results = llm.beam_search(prompts, params)
    gen_s = time.perf_counter() - t1
    for i, (p, r) in enumerate(zip(prompts, results)):
        n_prompt = len(engine._tokenize(p)[1])
        shown = (args.prompt or DEFAULT_PROMPTS)[i] if tok is not None else f"{n_prompt} token ids"
        print(f"--- [{i}] {shown}")
        for rank, seq in enumerate(r.sequences):
            new = seq.tokens[n_prompt:]
            text = tok.decode(new).strip() if tok is not None else " ".join(map(str, new))
            print(f"  beam {rank}: cum logprob {seq.cum_logprob:.3f}, finish {seq.finish_reason}: {text}")
    stats = engine.get_stats()
    print(f"\nmodel {args.model} on {engine.runner.backend} ({_device()}), load {load_s:.1f} s; "
          f"beam search width {args.beam_width}, {args.max_tokens} rounds in {gen_s:.2f} s "
          f"(includes {stats['num_compiles'] - c0} compiles); prefix-cache hits {stats['prefix_hit_tokens']} tokens")
    return 0


def _host_devices(n: int) -> None:
    """Asks for ``n`` CPU host devices. XLA reads XLA_FLAGS when jax's backends start (the
    first device query, after this; importing jax does not start them). The flag only
    concerns the host platform, so on GPU / TPU nothing changes."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _device() -> str:
    import jax

    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')}"
