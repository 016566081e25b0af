"""N-gram speculative decoding A/B: the same engine without and with drafts, in ONE process.

    python benchmarks/spec_decode.py [--model smollm2-135m-instruct] [--k 4] [--lookup 4,2]
        [--max-tokens 64] [--rounds 3] [--workload copy|open|all] [--batch 1|all|both] [--json PATH]
        [--plot]

Two workloads of greedy chat requests on a real model (n-gram drafts only pay where the output
repeats its context, which a random-weight model never does):
  copy:  "repeat / lightly edit this passage" (the output copies the prompt);
  open:  open-ended questions (little to copy).
Each runs at batch 1 (one request at a time: the latency case, where a step's weights cost the
same for 1 or k + 1 tokens) and with all requests at once. Timed passes alternate the two
engines (plain, spec, spec, plain, ...); prints seconds per pass, the plain / spec ratio
(> 1: speculation is faster), the draft acceptance and whether the greedy tokens are equal;
writes JSON, and with ``--plot`` a PNG next to it (median seconds per pass, plain vs spec, per
workload and batch).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import bench_common as bc
import engine_harness as eh

PASSAGE = (
    "A paged KV cache stores the keys and values of every token in fixed-size blocks. "
    "Blocks are allocated on demand, freed when a request ends, and shared between "
    "requests whose prompts begin with the same tokens, so memory follows the work that "
    "is actually running instead of the longest request anyone might send."
)
WORKLOADS = {
    "copy": [
        f"Repeat this passage exactly, word for word:\n\n{PASSAGE}",
        f"Copy this text and change nothing:\n\n{PASSAGE}",
        f"Rewrite this passage with 'blocks' replaced by 'pages':\n\n{PASSAGE}",
        f"Here is a paragraph. Write it out again verbatim.\n\n{PASSAGE}",
    ],
    "open": [
        "Name three colours and say what each one reminds you of.",
        "What is a good way to learn a new programming language?",
        "Write two sentences about the sea.",
        "Why do people keep pets?",
    ],
}


def _pass(engine, prompts, max_tokens, tag, batch_all: bool) -> tuple[float, list[list[int]]]:
    groups = [prompts] if batch_all else [[p] for p in prompts]
    done, t0 = {}, time.perf_counter()
    for g, group in enumerate(groups):
        for i, p in enumerate(group):
            engine.add_request(f"{tag}-{g}-{i}", p, eh.greedy(max_tokens))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    elapsed = time.perf_counter() - t0
    if not engine.scheduler.reset_prefix_cache():
        raise RuntimeError("could not reset the prefix cache between passes")
    return elapsed, [done[k] for k in sorted(done)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup", default="4,2", help="prompt_lookup_max,prompt_lookup_min")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workload", default="all", choices=tuple(WORKLOADS) + ("all",))
    p.add_argument(
        "--batch",
        default="both",
        choices=("1", "all", "both"),
        help="one request at a time, all at once, or both",
    )
    p.add_argument("--json", default=str(bc.RESULTS_DIR / "spec_decode.json"))
    p.add_argument(
        "--plot", action="store_true", help="also write a PNG next to the JSON (needs matplotlib)"
    )
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    hi, lo = (int(x) for x in args.lookup.split(","))
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": hi,
        "prompt_lookup_min": lo,
    }
    from _throughput_workloads import load_model

    model, tok = load_model(args.model, 0)
    if tok is None or not tok.chat_template:
        p.error(
            f"{args.model} has no tokenizer with a chat template; the workloads are chat prompts"
        )
    prompts = {
        w: [
            tok.encode(
                tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False
            )
            for t in texts
        ]
        for w, texts in WORKLOADS.items()
        if args.workload in (w, "all")
    }
    batch_modes = {"1": (False,), "all": (True,), "both": (False, True)}[args.batch]
    env = bc.environment()
    workload = dict(
        model=args.model,
        requests_per_workload=4,
        max_tokens=args.max_tokens,
        greedy=True,
        speculative=spec,
    )
    print(
        "\n".join(
            bc.header_lines("n-gram speculative decoding A/B (jaxkv, one process)", env, workload)
        )
    )
    engines = {}
    for mode, cfg in (("plain", None), ("spec", spec)):
        engines[mode], _ = eh.build_engine(
            model,
            tok,
            max_num_seqs=8,
            max_num_batched_tokens=2048,
            kv_cache_memory_bytes=256 << 20,
            max_model_len=2048,
            speculative_config=cfg,
        )
    rows = []
    for w, ps in prompts.items():
        for batch_all in batch_modes:
            for mode in engines:  # warm pass: compiles the shapes the timed passes use
                _pass(engines[mode], ps, args.max_tokens, f"warm-{w}-{mode}", batch_all)
            times, tokens = {"plain": [], "spec": []}, {}
            e = engines["spec"].runner
            d0, a0 = e.num_draft_tokens, e.num_accepted_tokens
            for r in range(args.rounds):
                for mode in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):
                    t, toks = _pass(
                        engines[mode], ps, args.max_tokens, f"{w}-{r}-{mode}", batch_all
                    )
                    times[mode].append(t)
                    tokens.setdefault(mode, toks)
            drafts, accepted = e.num_draft_tokens - d0, e.num_accepted_tokens - a0
            out_tokens = sum(map(len, tokens["plain"]))
            row = {
                "workload": w,
                "batch": len(ps) if batch_all else 1,
                "plain_s": statistics.median(times["plain"]),
                "spec_s": statistics.median(times["spec"]),
                "output_tokens": out_tokens,
                "drafts": drafts,
                "accepted": accepted,
                "acceptance_pct": 100.0 * accepted / drafts if drafts else 0.0,
                "tokens_equal": f"{sum(a == b for a, b in zip(tokens['plain'], tokens['spec']))}/{len(ps)}",
                "times_s": times,
            }
            row["plain_over_spec"] = row["plain_s"] / row["spec_s"]
            rows.append(row)
            print(
                f"# {w} batch {row['batch']}: plain {row['plain_s']:.2f} s, spec {row['spec_s']:.2f} s, "
                f"{row['plain_over_spec']:.2f}x",
                file=sys.stderr,
                flush=True,
            )
    cols = [
        "workload",
        "batch",
        "output_tokens",
        "plain_s",
        "spec_s",
        "plain_over_spec",
        "acceptance_pct",
        "tokens_equal",
    ]
    print(bc.table(rows, cols, "median pass (s); plain / spec > 1: speculation is faster"))
    payload = {"env": env, "workload": workload, "rounds": args.rounds, "rows": rows}
    print(f"# wrote {bc.write_json(args.json, payload)}", file=sys.stderr)
    if args.plot:
        groups = {
            f"{r['workload']} batch {r['batch']}": {"plain": r["plain_s"], "spec": r["spec_s"]}
            for r in rows
        }
        png = bc.plot_bars(
            pathlib.Path(args.json).with_suffix(".png"),
            bc.plot_title(f"n-gram speculation, k {args.k}\n{args.model}", env),
            groups,
            "median seconds per pass",
        )
        if png:
            print(f"# wrote {png}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
