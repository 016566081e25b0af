"""Static shape buckets: few shapes, so steady-state serving never compiles."""

from __future__ import annotations


def pow2_at_least(n: int, min_size: int = 1) -> int:
    """Doubles from ``max(min_size, 1)`` until it is >= n: ``pow2_at_least(5, 4) == 8``."""
    size = max(min_size, 1)
    while size < n:
        size *= 2
    return size


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from ``lo`` up to ``hi``, plus ``hi`` itself when it is not one.

    Example: ``pow2_buckets(16, 96) == (16, 32, 64, 96)``.
    """
    if lo < 1 or hi < 1:
        raise ValueError(f"bucket bounds must be >= 1, got lo={lo}, hi={hi}")
    out, b = [], 1
    while b < lo:
        b *= 2
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def token_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two and the midpoints 1.5x between them, from ``lo`` to ``hi`` (inclusive).

    Padding a step to its bucket wastes at most a third of the tokens (half with powers of
    two alone), for twice the shapes. Example: ``token_buckets(16, 100) == (16, 24, 32, 48,
    64, 96, 100)``.
    """
    out = []
    for b in pow2_buckets(lo, hi):
        out.append(b)
        mid = b + b // 2
        if b & (b - 1) == 0 and b >= 8 and mid < hi:
            out.append(mid)
    return tuple(sorted(set(x for x in out if x <= hi)))


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n; ValueError if n exceeds the largest."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
