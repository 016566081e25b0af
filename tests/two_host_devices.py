"""Running a cases file on two CPU host devices, in a fresh interpreter: jax fixes its device
count when it starts, and the suite runs on one CPU device."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_cases_on_two_host_devices(cases: str, timeout_s: float = 900) -> None:
    """Runs ``pytest cases`` (a path under the repository root) with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=2``; AssertionError with the output's
    tail unless every case passed and none was skipped or deselected."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cases],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert (
        " passed" in proc.stdout
        and "skipped" not in proc.stdout
        and "deselected" not in proc.stdout
    ), tail
