"""The throughput benchmark's output: the report's tables, its headline figures, and the plots."""

from __future__ import annotations

import pathlib

import bench_common as bc
from _throughput_flops import FLOPS_FORMULA


def print_report(payload: dict) -> None:
    env = payload["env"]
    print("\n".join(bc.header_lines("jaxkv offline throughput", env, payload["config"])))
    mm = payload["matmul"]
    print(
        f"# matmul probe: {mm['n']}x{mm['n']} fp32 jnp.dot, best of {mm['repeats']}: "
        f"{mm['flops_per_s'] / 1e9:.1f} GFLOP/s at the start, "
        f"{payload['matmul_end']['flops_per_s'] / 1e9:.1f} at the end; MFU uses the higher"
    )
    chain = payload.get("model_matmuls")
    if chain:
        d, p = chain["decode"], chain["prefill"]
        print(
            f"# the model's own matmul chain in XLA (random fp32 weights, no attention / cache): "
            f"{d['rows']} rows + LM head {d['flops_per_s'] / 1e9:.1f} GFLOP/s "
            f"({d['pct_of_matmul_probe']:.0f}% of the probe), {p['rows']} rows "
            f"{p['flops_per_s'] / 1e9:.1f} GFLOP/s ({p['pct_of_matmul_probe']:.0f}%)"
        )
    print(f"# {FLOPS_FORMULA}")
    rows, summary = [], []
    for name, res in payload["results"].items():
        if name == "long-decode":
            continue
        for r in res["rows"]:
            rows.append(
                dict(
                    r,
                    workload=name,
                    **{
                        "GFLOP/s": r["model_flops_per_s"] / 1e9,
                        "host%": r.get("host", {}).get("host_pct"),
                    },
                )
            )
        if "jaxkv_over_baseline" in res:
            summary.append(
                {
                    "workload": name,
                    "jaxkv/baseline out tok/s": res["jaxkv_over_baseline"],
                    "greedy tokens equal": res["baseline_tokens_equal"],
                }
            )
    if rows:
        print(
            bc.table(
                rows,
                [
                    "workload",
                    "system",
                    "requests",
                    "elapsed_s",
                    "req_per_s",
                    "output_tok_per_s",
                    "total_tok_per_s",
                    "GFLOP/s",
                    "mfu_pct_of_matmul",
                    "peak_kv_pct",
                    "preemptions",
                    "compiles",
                    "host%",
                ],
                "throughput",
            )
        )
        print(
            bc.table(
                rows,
                [
                    "workload",
                    "system",
                    "ttft_ms_mean",
                    "ttft_ms_median",
                    "ttft_ms_p99",
                    "tpot_ms_mean",
                    "tpot_ms_median",
                    "tpot_ms_p99",
                    "compile_s",
                ],
                "latency",
            )
        )
        host = [
            dict(workload=n, **r["host_decode"])
            for n, res in payload["results"].items()
            if n != "long-decode"
            for r in res["rows"]
            if "host_decode" in r
        ]
        print(
            bc.table(
                host,
                [
                    "workload",
                    "batch",
                    "steps",
                    "step_ms_median",
                    "host_pct",
                    "schedule_pct",
                    "prepare_pct",
                    "update_pct",
                    "device_pct",
                ],
                "jaxkv decode steps at the largest batch (host = step - device)",
            )
        )
    sp = payload["results"].get("shared-prefix", {}).get("prefix")
    if sp:
        print(bc.table([sp], list(sp), "shared-prefix: prefix caching"))
    ld = payload["results"].get("long-decode")
    if ld:
        print(
            bc.table(
                ld["rows"],
                [
                    "context",
                    "batch",
                    "jaxkv_step_ms",
                    "jaxkv_device_ms",
                    "width_blocks",
                    "measured_steps",
                    "naive_step_ms",
                    "jaxkv_speedup",
                ],
                "long-decode: decode step time",
            )
        )
        print(
            bc.table(
                [ld["kv_size_compare"]], list(ld["kv_size_compare"]), "decode step vs KV-cache size"
            )
        )
    if summary:
        print(bc.table(summary, list(summary[0]), "jaxkv / naive JAX baseline"))
    print(bc.table(payload["headline"], ["figure", "value"], "headline figures"))


def headline_figures(payload: dict) -> list[dict]:
    """The run's main figures, one line each: jaxkv over the baseline, the share of the matmul
    probe's FLOP/s, the prefix cache's savings, the host's share of a decode step and the
    decode step on a large vs a small KV cache."""
    res = payload["results"]
    out = []

    def add(name, value):
        out.append({"figure": name, "value": value})

    for w in ("fixed", "mixed"):
        r = res.get(w, {}).get("jaxkv_over_baseline")
        if r is not None:
            add(f"{w}: jaxkv / naive JAX, output tok/s", f"{r:.2f}x")
    f = res.get("fixed", {}).get("rows", [{}])[0].get("mfu_pct_of_matmul")
    if f is not None:
        add("fixed: model FLOP/s, share of the matmul probe", f"{f:.1f}%")
    chain = payload.get("model_matmuls")
    if chain:
        add(
            "XLA on the model's matmuls alone, decode / prefill rows",
            f"{chain['decode']['pct_of_matmul_probe']:.0f}% / {chain['prefill']['pct_of_matmul_probe']:.0f}%"
            " of the matmul probe",
        )
    sp = res.get("shared-prefix", {}).get("prefix")
    if sp:
        add(
            "shared-prefix: prefill saved by prefix caching",
            f"{bc.fmt(sp['prefill_saved_pct'])}% (ideal {bc.fmt(sp['ideal_saved_pct'])}%), "
            f"speedup {sp['speedup_on_vs_off']:.2f}x",
        )
    for w in ("fixed", "mixed"):
        hd = res.get(w, {}).get("rows", [{}])[0].get("host_decode", {})
        if hd.get("steps"):
            add(f"{w}: host share of a decode step (batch {hd['batch']})", f"{hd['host_pct']:.1f}%")
    kv = res.get("long-decode", {}).get("kv_size_compare", {})
    if kv.get("large_over_small"):
        add("long-decode: decode step, large / small KV cache", f"{kv['large_over_small']:.3f}x")
    return out


def plot(payload, json_path: pathlib.Path) -> None:
    groups = {
        n: {r["system"]: r["output_tok_per_s"] for r in res["rows"]}
        for n, res in payload["results"].items()
        if n != "long-decode"
    }
    title = f"{payload['config']['model']} on {payload['env']['cpu']} x{payload['env']['cores']}"
    written = []
    if groups:
        written.append(
            bc.plot_bars(json_path.with_suffix(".png"), title, groups, "output tokens/s")
        )
    ld = payload["results"].get("long-decode")
    if ld:
        series = {}
        for b in sorted({r["batch"] for r in ld["rows"]}):
            rs = [r for r in ld["rows"] if r["batch"] == b]
            series[f"jaxkv batch {b}"] = (
                [r["context"] for r in rs],
                [r["jaxkv_step_ms"] for r in rs],
            )
            if "naive_step_ms" in rs[0]:
                series[f"naive batch {b}"] = (
                    [r["context"] for r in rs],
                    [r["naive_step_ms"] for r in rs],
                )
        written.append(
            bc.plot_lines(
                json_path.with_name(json_path.stem + "_long_decode.png"),
                title,
                series,
                "context (tokens)",
                "decode step (ms)",
            )
        )
    for w in written:
        if w:
            print(f"# wrote {w}")
