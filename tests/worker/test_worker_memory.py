"""Worker start-up (issue 23): the front end reads a named model's config only and the
worker loads the weights (onto its mesh: tests/engine/tp_cases.py)."""

from __future__ import annotations

import pytest

import jaxkv.models.registry as registry
from jaxkv.engine_config import resolve_engine_config
from jaxkv.models import hf_state_dict
from jaxkv.models.checkpoint import write_safetensors_dir
from jaxkv.models.checkpoint.safetensors_dir import SafetensorsTensors
from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.worker import Worker
from tests.engine.helpers import dense_greedy, make_llm, small_model
from tests.models.ckpt_fixtures import hf_config_dict

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small Llama as an HF safetensors directory (a model name the workers load), and
    the same model built in process (the dense reference)."""
    model = small_model("tiny-llama", seed=5)
    path = tmp_path_factory.mktemp("ckpt") / "small-llama"
    write_safetensors_dir(path, hf_config_dict(model.config), hf_state_dict(model))
    return str(path), model


def _worker(llm) -> Worker:
    return llm.llm_engine.engine_core.model_executor.driver_worker.worker


def test_front_end_reads_no_weights_and_the_worker_loads_once(checkpoint, monkeypatch):
    """A model named by path: resolve_engine_config reads its config only (no tensor read,
    no parameter built); the worker loads it once, on its mesh (None: one device), and
    greedy tokens equal the dense forward of the checkpoint's model."""
    path, model = checkpoint

    def no_weights(*args, **kwargs):
        raise AssertionError("the front end touched the weights")

    with monkeypatch.context() as m:
        m.setattr(SafetensorsTensors, "read", no_weights)
        m.setattr(registry, "load_model", no_weights)
        m.setattr(registry, "build_model", no_weights)
        loaded, config, _, engine_config = resolve_engine_config(path, **LIMITS, warmup=False)
    assert loaded is None and engine_config.model == path and config == model.config
    loads = []
    real_load = registry.load_model
    monkeypatch.setattr(registry, "load_model", lambda *a, **k: loads.append(k) or real_load(*a, **k))
    llm = make_llm(path, **LIMITS)
    assert [k["mesh"] for k in loads] == [None]
    prompt = list(range(3, 20))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)
    assert out.outputs[0].token_ids == dense_greedy(model, prompt, 6)


def test_a_built_model_is_served_as_given():
    """LLM(model object): the worker serves that object (nothing is loaded by name; its
    tokens are checked by the engine tests, which all build their models)."""
    model = small_model("tiny-llama", seed=5)
    llm = make_llm(model, **LIMITS)
    assert _worker(llm).model is model and llm.llm_engine.config.model is None
