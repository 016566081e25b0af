"""The install layout: models/ and pallas_kernels/ are jaxkv.models and jaxkv.pallas_kernels,
so a user's own ``models`` package and jaxkv's never shadow each other."""

import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAPPED = {
    "jaxkv": ROOT / "jaxkv",
    "jaxkv.models": ROOT / "models",
    "jaxkv.pallas_kernels": ROOT / "pallas_kernels",
}


def _packages_in_tree() -> set[str]:
    found = set()
    for prefix, folder in MAPPED.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            if prefix == "jaxkv" and rel.parts[:1] in (("models",), ("pallas_kernels",)):
                continue
            found.add(".".join((prefix, *rel.parts)))
    return found


def test_pyproject_lists_every_package():
    """A subpackage missing from pyproject's explicit list would be left out of the wheel."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(conf["packages"]) == _packages_in_tree()
    assert conf["package-dir"] == {
        "jaxkv.models": "models",
        "jaxkv.pallas_kernels": "pallas_kernels",
    }


USER_SCRIPT = """
import sys
import models                                   # the user's own package
from jaxkv import LLM, SamplingParams
import jaxkv.models
assert models.NAME == "user's", models.__file__
assert jaxkv.models.__file__ != models.__file__
llm = LLM("tiny-llama", kv_cache_memory_bytes=32 << 20, max_model_len=64, warmup=False)
out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 3
assert "pallas_kernels" not in sys.modules and sys.modules["models"] is models
print("ok")
"""


def _run_in_user_dir(tmp_path, env_extra=None):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text('NAME = "user\'s"\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(JAX_PLATFORMS="cpu", **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-c", USER_SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_jaxkv_from_a_directory_with_its_own_models_package(tmp_path):
    """As installed for the suite (editable): the user's ``models`` is theirs, jaxkv runs."""
    proc = _run_in_user_dir(tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.slow
def test_built_wheel_maps_the_folders_under_jaxkv(tmp_path):
    """The wheel itself (not the checkout) holds jaxkv/models and jaxkv/pallas_kernels and no
    top-level models package; installed into a target directory it serves from the user's dir."""
    wheels = tmp_path / "wheels"  # pip builds it in isolation (setuptools from the registry)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    (wheel,) = wheels.glob("jaxkv-*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "jaxkv/models/__init__.py" in names and "jaxkv/pallas_kernels/__init__.py" in names
    assert "jaxkv/pallas_kernels/cpu_kernels/paged_attention.cc" in names
    assert not any(n.startswith(("models/", "pallas_kernels/")) for n in names)
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    user = tmp_path / "user"
    user.mkdir()
    proc = _run_in_user_dir(user, {"PYTHONPATH": str(target)})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
