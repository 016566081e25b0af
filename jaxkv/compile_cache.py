"""jax's persistent compilation cache for the engine: restarts read compiled programs back.

``LLM``, ``jaxkv generate`` and ``jaxkv serve`` turn it on by default (``enable``), in a
directory under jaxkv's cache dir (``~/.cache/jaxkv/xla``, or ``$JAXKV_CACHE_DIR/xla``). A
second start with the same configuration then compiles nothing: each program is lowered (to
compute its key) and read back.

Where it goes, in order of precedence:
  1. the engine argument ``compile_cache`` (``LLM(..., compile_cache=...)``, ``--compile-cache``):
     a directory, or ``False`` / ``"off"`` to leave jax's cache alone;
  2. the environment variable ``JAXKV_COMPILE_CACHE``: a directory, or ``off``;
  3. a directory the process already gave jax (``jax_compilation_cache_dir``): kept;
  4. the default above.

It is safe to share between processes and jax versions: jax keys every entry by the program,
the compile options, the jax / jaxlib versions and the device, and writes each entry once. A
process reading an entry another is still writing gets an error it logs and recompiles. The
cache is trusted code: do not point it at a directory others can write to (jax's warning).
Every program is cached, whatever its compile time (``jax_persistent_cache_min_compile_time_secs
= 0``): a start compiles dozens of small programs that add up.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "JAXKV_COMPILE_CACHE"
_OFF = ("off", "0", "false", "no", "none")


def default_dir() -> Path:
    from jaxkv.models.checkpoint.smollm2 import cache_dir  # lazy: jaxkv's cache dir

    return cache_dir() / "xla"


def resolve(setting: bool | str | os.PathLike | None = True) -> Path | None:
    """The directory ``setting`` (the engine argument) means, or None for "leave jax alone"."""
    if setting is False or (isinstance(setting, str) and setting.strip().lower() in _OFF):
        return None
    if isinstance(setting, (str, os.PathLike)) and str(setting).strip():
        return Path(setting).expanduser()
    if setting not in (True, None):
        raise TypeError(f"compile_cache must be True, False, 'off' or a directory, got {setting!r}")
    env = os.environ.get(ENV, "").strip()
    if env.lower() in _OFF:
        return None
    if env:
        return Path(env).expanduser()
    import jax

    current = jax.config.jax_compilation_cache_dir
    return Path(current) if current else default_dir()


def enable(setting: bool | str | os.PathLike | None = True) -> Path | None:
    """Points jax's persistent cache at :func:`resolve` (``setting``)'s directory; returns it
    (None: left as it was). Safe to call again, and after jax has compiled something."""
    path = resolve(setting)
    if path is None:
        return None
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if jax.config.jax_compilation_cache_dir != str(path):
        path.mkdir(parents=True, exist_ok=True)
        cc.set_cache_dir(str(path))
        cc.reset_cache()  # a cache jax had already set up (or found off) is looked up again
    return path


def current() -> str | None:
    """The directory jax's persistent cache uses in this process, or None."""
    import jax

    return jax.config.jax_compilation_cache_dir or None
