"""The n-gram proposer's host cost per request and step, against the plain sliding-window search.

    python benchmarks/ngram_proposer.py [--lengths 256,4096,16384] [--vocabs 32000,50] [--json PATH]
        [--plot]

A drafted request runs ``propose_ngram`` over its whole token history after every step, so
its cost grows with the context. The baseline is the straightforward numpy search (every
window of n tokens compared with the last n, for n from max down to min), which jaxkv used
until 2026-11-30; jaxkv's proposer compares every token with the last one once and extends
only those candidates backwards. Both must return the same drafts (checked on every input).
Random tokens from a large vocabulary (few candidates) and a small one (many), n-grams 5..1,
k = 4; median of 7 repeats of 50 calls. Writes JSON, and with ``--plot`` a PNG next to it
(microseconds per call vs tokens, one line per implementation and vocabulary).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import bench_common as bc
import numpy as np

from jaxkv.worker.spec_decode import propose_ngram


def baseline_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Every window of each n compared with the last n tokens (O(L * n) per n)."""
    length = int(tokens.shape[0])
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


def _time(fn, tokens, repeats: int = 7, calls: int = 50) -> float:
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(tokens, 1, 5, 4)
        per.append((time.perf_counter() - t0) / calls)
    return statistics.median(per)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lengths", default="256,4096,16384")
    p.add_argument("--vocabs", default="32000,50")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(bc.RESULTS_DIR / "ngram_proposer.json"))
    p.add_argument(
        "--plot", action="store_true", help="also write a PNG next to the JSON (needs matplotlib)"
    )
    args = p.parse_args(argv)
    env = bc.environment()
    workload = dict(
        lengths=args.lengths, vocabs=args.vocabs, ngram="5..1", k=4, calls=50, repeats=7
    )
    print(
        "\n".join(
            bc.header_lines("n-gram proposer: jaxkv vs the sliding-window search", env, workload)
        )
    )
    rng = np.random.default_rng(args.seed)
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for length in (int(x) for x in args.lengths.split(",")):
            tokens = rng.integers(0, vocab, length).astype(np.int32)
            for cut in range(2, 40):  # same drafts on many prefixes of the input
                if propose_ngram(tokens[:cut], 1, 5, 4) != baseline_propose(tokens[:cut], 1, 5, 4):
                    raise AssertionError(f"drafts differ on {tokens[:cut].tolist()}")
            if propose_ngram(tokens, 1, 5, 4) != baseline_propose(tokens, 1, 5, 4):
                raise AssertionError(f"drafts differ at length {length}, vocab {vocab}")
            base, new = _time(baseline_propose, tokens), _time(propose_ngram, tokens)
            rows.append(
                {
                    "vocab": vocab,
                    "tokens": length,
                    "baseline_us": 1e6 * base,
                    "jaxkv_us": 1e6 * new,
                    "speedup": base / new,
                }
            )
    print(
        bc.table(
            rows,
            ["vocab", "tokens", "baseline_us", "jaxkv_us", "speedup"],
            "microseconds per call (median); speedup = baseline / jaxkv",
        )
    )
    payload = {"env": env, "workload": workload, "rows": rows}
    print(f"# wrote {bc.write_json(args.json, payload)}", file=sys.stderr)
    if args.plot:
        series = {}
        for impl in ("baseline", "jaxkv"):
            for vocab in dict.fromkeys(r["vocab"] for r in rows):
                rs = [r for r in rows if r["vocab"] == vocab]
                series[f"{impl}, vocab {vocab}"] = (
                    [r["tokens"] for r in rs],
                    [r[f"{impl}_us"] for r in rs],
                )
        png = bc.plot_lines(
            pathlib.Path(args.json).with_suffix(".png"),
            bc.plot_title("n-gram proposer", env),
            series,
            "tokens",
            "microseconds per call",
        )
        if png:
            print(f"# wrote {png}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
