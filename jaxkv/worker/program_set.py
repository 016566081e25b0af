"""The engine's compiled programs: a small set known at start-up, compiled once.

Every distinct program is one XLA compile (seconds on a CPU, many more for an accelerator and
a real model), so the runner's programs are keyed by as few sizes as possible and their number
is a sum, not a product (:func:`program_keys`):

=====================  =========================  ============================================
program                one per                    what it does
=====================  =========================  ============================================
``forward[T]``         token bucket T             diff, zeroing, embed, layers, KV, attention
                                                  (T <= max_num_seqs: + the greedy head, on a flag)
``greedy[S]``          request bucket S           LM head + argmax of S rows (S < T)
``sample[S]``          request bucket S           LM head + the general sampler of S rows
``verify[P]``          scored-position bucket P   LM head + draft verification (speculative only)
``prompt_logprobs[T]`` token bucket T             LM head + logprobs of every token's target
``table_ops``          -                          a block-table diff that did not fit a step
``zero_pages``         -                          pages to zero that did not fit a step
``sampling_update``    -                          requests entering the device sampling state
=====================  =========================  ============================================

So with F token buckets, Q request buckets and V position buckets the engine runs at most
``2 F + 2 Q + V + 3`` programs (``num_programs``); warm-up compiles all of them, the compiles
spread over a thread pool (XLA compiles outside the GIL), and a compile after warm-up is a bug:
counted (``late_compiles``) and logged with the program's name. With jax's persistent
compilation cache on (``jaxkv.compile_cache``) a restart with the same configuration reads
every program back instead of compiling it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable

import jax

logger = logging.getLogger("jaxkv")

FORWARD, GREEDY, SAMPLE, VERIFY, PROMPT_LOGPROBS = (
    "forward",
    "greedy",
    "sample",
    "verify",
    "prompt_logprobs",
)
TABLE_OPS, ZERO_PAGES, SAMPLING_UPDATE = "table_ops", "zero_pages", "sampling_update"


@dataclasses.dataclass(frozen=True, order=True)
class ProgramKey:
    """One compiled program: its kind and the size it is keyed by (0 for the fixed ones)."""

    kind: str
    size: int = 0

    def __str__(self) -> str:
        return f"{self.kind}[{self.size}]" if self.size else self.kind


def program_keys(
    *,
    token_buckets: Iterable[int],
    seq_buckets: Iterable[int],
    spec_buckets: Iterable[int] = (),
    generate: bool = True,
) -> list[ProgramKey]:
    """Every program an engine with these buckets can run (``generate=False``: a pooling-only
    engine, which never samples). Forwards first: they are the longest compiles."""
    token_buckets, seq_buckets = list(token_buckets), list(seq_buckets)
    keys = [ProgramKey(FORWARD, t) for t in token_buckets]
    if generate:
        keys += [ProgramKey(GREEDY, s) for s in seq_buckets] + [
            ProgramKey(SAMPLE, s) for s in seq_buckets
        ]
        keys += [ProgramKey(VERIFY, p) for p in spec_buckets]
        keys += [ProgramKey(PROMPT_LOGPROBS, t) for t in token_buckets]
    keys += [ProgramKey(TABLE_OPS), ProgramKey(ZERO_PAGES)]
    if generate:
        keys.append(ProgramKey(SAMPLING_UPDATE))
    return keys


def num_programs(
    *,
    num_token_buckets: int,
    num_seq_buckets: int,
    num_spec_buckets: int = 0,
    generate: bool = True,
) -> int:
    """``len(program_keys(...))``: 2 F + 2 Q + V + 3 when generating, F + 2 for pooling only."""
    if not generate:
        return num_token_buckets + 2
    return 2 * num_token_buckets + 2 * num_seq_buckets + num_spec_buckets + 3


@dataclasses.dataclass(frozen=True)
class Program:
    """How to build one program: the function, the arguments it donates, abstract arguments."""

    fn: Callable
    donate_argnums: tuple[int, ...]
    abstract_args: Callable[[], tuple]  # ShapeDtypeStructs (with shardings) of its arguments


class ProgramSet:
    """The runner's compiled programs, compiled ahead of time and called by key.

    Args:
      build: ``key -> Program``.
    """

    def __init__(self, build: Callable[[ProgramKey], Program]):
        self._build = build
        self._compiled: dict[ProgramKey, object] = {}
        self._lock = threading.Lock()
        self.num_compiles = 0  # programs compiled (or read from the persistent cache)
        self.compile_seconds = 0.0  # wall time spent compiling them (warm-up: all threads')
        self.late_compiles: list[str] = []  # programs compiled after warm-up (names)
        self.warmed_up = False

    def __contains__(self, key: ProgramKey) -> bool:
        return key in self._compiled

    @property
    def keys(self) -> list[ProgramKey]:
        return sorted(self._compiled)

    def _lower(self, key: ProgramKey):
        p = self._build(key)
        return jax.jit(p.fn, donate_argnums=p.donate_argnums).lower(*p.abstract_args())

    def get(self, key: ProgramKey):
        """The compiled program (compiled now if it is not yet: after warm-up that is counted
        in ``late_compiles`` and logged as a warning)."""
        compiled = self._compiled.get(key)
        if compiled is None:
            if self.warmed_up:
                self.late_compiles.append(str(key))
                logger.warning(
                    "jaxkv: compiling %s after warm-up: a program the warm-up did not "
                    "cover (a bug: please report it with the engine's configuration)",
                    key,
                )
            t0 = time.perf_counter()
            compiled = self._lower(key).compile()
            self.compile_seconds += time.perf_counter() - t0
            self.num_compiles += 1
            self._compiled[key] = compiled
        return compiled

    def __call__(self, key: ProgramKey, *args):
        return self.get(key)(*args)

    def warm_up(
        self, keys: Iterable[ProgramKey], *, progress: bool = True, workers: int | None = None
    ) -> None:
        """Compiles every key not compiled yet: lowered one after another (tracing holds the
        GIL), each compiled in a thread pool as soon as it is lowered; then later compiles are
        counted as late. A progress line on stderr when ``progress``."""
        todo = [k for k in dict.fromkeys(keys) if k not in self._compiled]
        workers = workers or max(
            1,
            min(
                len(os.sched_getaffinity(0))
                if hasattr(os, "sched_getaffinity")
                else (os.cpu_count() or 1),
                8,
            ),
        )
        t0 = time.perf_counter()
        done = [0]

        def show():
            if progress:
                print(
                    f"\rjaxkv: compiling programs {done[0]}/{len(todo)} ({time.perf_counter() - t0:.1f} s)",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )

        def compile_one(key, lowered):
            compiled = lowered.compile()
            with self._lock:
                self._compiled[key] = compiled
                done[0] += 1
                show()

        show()
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(compile_one, key, self._lower(key)) for key in todo]
            for future in futures:
                future.result()  # re-raises a failed compile
        self.num_compiles += len(todo)
        self.compile_seconds += time.perf_counter() - t0
        self.warmed_up = True
        if progress:
            print(file=sys.stderr)
