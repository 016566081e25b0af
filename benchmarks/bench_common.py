"""Shared parts of the end-to-end benchmarks: header, matmul probe, statistics, table, JSON, plot.

Every table carries the workload, the versions, the hardware and the number of cores
(STYLE.md: "numbers carry their hardware, versions and workload"). The hardware/version facts
extend ``_kernel_bench_common.environment()`` (the kernel benchmarks' helper) rather than
re-reading /proc/cpuinfo a second way.

Benchmarks are scripts, not a package: they import each other by file name, which works when
run as ``python benchmarks/<name>.py`` (the script's folder is ``sys.path[0]``) and from
``jaxkv bench`` (``jaxkv/entrypoints/cli_bench.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
import math
import pathlib
import platform
import statistics
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from _kernel_bench_common import environment as _kernel_environment
from _kernel_bench_common import time_fn

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


# ---- environment ------------------------------------------------------------------------------


def environment() -> dict:
    """CPU model, usable cores, load, python/jax/jaxlib/flax/numpy versions, platform, date."""
    import flax

    env = _kernel_environment()
    env.update(
        flax=flax.__version__,
        numpy=np.__version__,
        platform=platform.platform(),
        cpu_count_os=__import__("os").cpu_count(),
    )
    return env


def header_lines(title: str, env: dict, workload: dict | None = None) -> list[str]:
    load = env.get("load_avg")
    load_s = "/".join(f"{x:.1f}" for x in load) if load else "n/a"
    lines = [
        f"# {title}",
        f"# hardware: {env['cpu']}, {env['cores']} usable cores (os reports {env.get('cpu_count_os')}), "
        f"backend {env['backend']} ({env['device_kind']}), load avg {load_s}",
        f"# versions: python {env['python']}, jax {env['jax']}, jaxlib {env['jaxlib']}, "
        f"flax {env.get('flax')}, numpy {env.get('numpy')}; {env.get('platform')}",
        f"# date: {env['time']}",
    ]
    if workload:
        lines.append("# workload: " + ", ".join(f"{k}={v}" for k, v in workload.items()))
    return lines


# ---- the machine's own limit ------------------------------------------------------------------


def matmul_flops(n: int = 2048, repeats: int = 7, dtype=jnp.float32) -> dict:
    """Best-of-``repeats`` FLOP/s of a jitted ``n x n`` fp32 ``jnp.dot`` (2 n^3 FLOPs a call)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    t = time_fn(jax.jit(jnp.dot), a, b, repeats=repeats)
    flops = 2.0 * n**3
    return {
        "n": n,
        "dtype": jnp.dtype(dtype).name,
        "repeats": repeats,
        "best_s": t["min_s"],
        "median_s": t["median_s"],
        "flops_per_s": flops / t["min_s"],
        "flops_per_s_median": flops / t["median_s"],
    }


def model_matmul_flops(cfg, rows: int, *, lm_head: bool, repeats: int = 7) -> dict:
    """Best-of-``repeats`` FLOP/s of the model's own weight matmuls at ``rows`` tokens, in XLA.

    One jitted chain per call: every layer's q/k/v/o and gate/up/down projections (random fp32
    weights of ``cfg``'s shapes, a residual add in between, no norms, no attention, no cache),
    plus the LM head when ``lm_head``. It is what XLA:CPU reaches on exactly the model's matmul
    shapes, so it bounds any engine built on XLA's dots: a decode step at batch 64 is
    ``rows=64, lm_head=True``; a 2048-token prefill step is ``rows=2048, lm_head=False``.
    """
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kd = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = [(h, qd), (h, kd), (h, kd), (qd, h), (h, inter), (h, inter), (inter, h)]
    keys = iter(jax.random.split(jax.random.key(1), len(shapes) * cfg.num_hidden_layers + 2))
    layers = [
        [0.02 * jax.random.normal(next(keys), s, jnp.float32) for s in shapes]
        for _ in range(cfg.num_hidden_layers)
    ]
    head = (
        0.02 * jax.random.normal(next(keys), (h, cfg.vocab_size), jnp.float32) if lm_head else None
    )
    x = jax.random.normal(next(keys), (rows, h), jnp.float32)

    def chain(x, layers, head):
        for wq, wk, wv, wo, wg, wu, wd in layers:
            q, k, v = x @ wq, x @ wk, x @ wv
            x = x + (q + jnp.tile(k + v, qd // kd)) @ wo
            x = x + ((x @ wg) * (x @ wu)) @ wd
        return x if head is None else x @ head

    t = time_fn(jax.jit(chain), x, layers, head, repeats=repeats)
    flops = (
        2.0
        * rows
        * (
            cfg.num_hidden_layers * sum(a * b for a, b in shapes)
            + (h * cfg.vocab_size if lm_head else 0)
        )
    )
    return {
        "rows": rows,
        "lm_head": lm_head,
        "best_s": t["min_s"],
        "flops_per_s": flops / t["min_s"],
        "flops_per_s_median": flops / t["median_s"],
    }


# ---- statistics -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    vals = [v for v in values if v is not None]
    return float(np.percentile(vals, q)) if vals else None


def summarize(values: Sequence[float]) -> dict:
    """mean / median / p99 / n of the non-None values."""
    vals = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"mean": None, "median": None, "p99": None, "n": 0}
    return {
        "mean": statistics.fmean(vals),
        "median": statistics.median(vals),
        "p99": percentile(vals, 99),
        "n": len(vals),
    }


# ---- output -----------------------------------------------------------------------------------


def fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.{digits - 1}e}"
        return f"{v:.{digits}g}"
    if isinstance(v, (list, tuple)):
        return " / ".join(fmt(x, digits) for x in v)
    return str(v)


def table(rows: list[dict], columns: list[str], title: str | None = None) -> str:
    """One plain-text table (markdown pipes, so it pastes into RESULTS.md as is)."""
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    line = lambda xs: "| " + " | ".join(x.rjust(w) for x, w in zip(xs, widths)) + " |"  # noqa: E731
    out = [] if title is None else [f"## {title}"]
    out += [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in cells]
    return "\n".join(out)


def write_json(path: str | pathlib.Path, payload: dict) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
    return path


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


NO_MATPLOTLIB = "# --plot: matplotlib is not installed (pip install 'jaxkv[bench]'); no PNG written"


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_title(what: str, env: dict) -> str:
    """A PNG's title: what it shows, then the hardware (a plot carries it as a table does)."""
    return f"{what}\n{env['cpu']}, {env['cores']} cores"


def plot_bars(
    path: str | pathlib.Path, title: str, groups: dict[str, dict[str, float]], ylabel: str
) -> pathlib.Path | None:
    """Grouped bar chart ``{group: {series: value}}`` to a PNG; None (and a note) without matplotlib."""
    if not have_matplotlib():
        print(NO_MATPLOTLIB, file=sys.stderr)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(groups)
    series = sorted({s for g in groups.values() for s in g})
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(names), 3.6))
    width = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [groups[n].get(s, 0.0) or 0.0 for n in names], width, label=s)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set_ylabel(ylabel)
    return _finish(plt, fig, ax, title, path)


def _finish(plt, fig, ax, title: str, path) -> pathlib.Path:
    """Title, legend, layout, then the PNG at ``path`` (folders made as needed)."""
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_lines(
    path: str | pathlib.Path,
    title: str,
    series: dict[str, tuple[list, list]],
    xlabel: str,
    ylabel: str,
) -> pathlib.Path | None:
    """Line chart ``{label: (xs, ys)}`` (log2 x axis) to a PNG; None (and a note) without matplotlib."""
    if not have_matplotlib():
        print(NO_MATPLOTLIB, file=sys.stderr)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _finish(plt, fig, ax, title, path)
