"""What every ``jaxkv`` sub-command shares: the argument types (byte sizes, token ids, n-gram
drafts, positive numbers), the help formatter, a parser whose usage errors are one line, the
one-line error, ``name_flags`` (the library's parameter names in a message -> the flags that
set them) and ``host_devices``.

A leaf: it imports no other module of jaxkv, so the sub-commands, ``EngineArgs`` and the
headless launcher can all import it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import textwrap
from collections.abc import Mapping

# "", "b"; "k", "kb" = 1000; "kib" = 1024; ... "p", "pb" = 1000**5; "pib" = 1024**5 (any case)
_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: base**i
    for i, prefix in enumerate("kmgtp", start=1)
    for suffix, base in (("", 1000), ("b", 1000), ("ib", 1024))
}


def parse_bytes(text: str) -> int:
    """'256MiB' -> 268435456; '1.5GiB', '2TB', '4e9', '1000' also work (units B, K/KB/KiB ..
    P/PB/PiB, any case; K..P are powers of 1000, Ki..Pi powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 256MiB or 2GiB)")
    try:
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (too large)")
    if int(value) <= 0:
        raise argparse.ArgumentTypeError(f"byte size must be positive: {text!r}")
    return int(value)


def parse_ngram(text: str) -> dict:
    """'K[,MAX[,MIN]]' -> the n-gram ``speculative_config`` dict: K drafts a step, n-grams
    MAX..MIN (default 4..1), e.g. '3' or '3,4,2'."""
    try:
        parts = [int(x) for x in str(text).split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3:
        raise argparse.ArgumentTypeError(f"expected K[,MAX[,MIN]] (e.g. 3 or 3,4,2), got {text!r}")
    k, hi, lo = (parts + [4, 1][len(parts) - 1 :])[:3]
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": hi,
        "prompt_lookup_min": lo,
    }


def parse_token_ids(text: str) -> list[int]:
    """'1,2,3' or '1 2 3' -> [1, 2, 3] (non-negative ints, at least one)."""
    words = [w for w in re.split(r"[\s,]+", str(text).strip()) if w]
    try:
        ids = [int(w) for w in words]
    except ValueError:
        ids = []
    if not ids or any(t < 0 for t in ids):
        raise argparse.ArgumentTypeError(
            f"expected non-negative token ids like 1,2,3, got {text!r}"
        )
    return ids


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {value}")
    return value


def positive_float(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help as plain text: descriptions and epilogs keep their line breaks (the examples),
    flag help wraps at spaces only (argparse's also breaks 'tiny-hybrid' at the hyphen), and
    the flag column gets 34 characters instead of 24."""

    def __init__(self, prog, **kwargs):
        kwargs.setdefault("max_help_position", 34)
        super().__init__(prog, **kwargs)

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, ``PROG: error: MESSAGE`` (the
    usage of ``generate`` alone is a screenful), exit code 2. Sub-parsers inherit the class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def error(command: str, message: str) -> int:
    """Prints ``jaxkv COMMAND: error: MESSAGE`` on stderr (one line) and returns exit code 2."""
    print(f"jaxkv {command}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def name_flags(message, flags: Mapping[str, str]) -> str:
    """The library's messages name its parameters; the CLI's name the flags. ``flags``: the
    parameter names -> the flags that set them (``EngineArgs.flag_names()`` and a command's
    own). 'max_tokens must be an int >= 1 (or None), got 0' -> '--max-tokens must be an int
    >= 1, got 0', and 'give the KV cache more memory' gains '(--kv-cache-memory)'. Whole
    names only: 'n-gram' and 'max_model_len_x' stay."""
    text = str(message)
    if flags:
        pattern = "|".join(re.escape(n) for n in sorted(flags, key=len, reverse=True))
        text = re.sub(rf"(?<![\w-])({pattern})(?![\w-])", lambda m: flags[m.group(1)], text)
    text = text.replace(" (or None)", "")
    return re.sub(r"(give the KV cache more memory)", r"\1 (--kv-cache-memory)", text, flags=re.I)


def host_devices(n: int) -> None:
    """Asks for ``n`` CPU host devices. XLA reads XLA_FLAGS when jax's backends start (the
    first device query, after this; importing jax does not start them). The flag only
    concerns the host platform, so on GPU / TPU nothing changes; a child process (the engine
    core of ``jaxkv serve``) inherits it."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
