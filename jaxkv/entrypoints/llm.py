"""LLM: offline batch generation and pooling over an ``LLMEngine``, shaped like ``vllm.LLM``.

Quick start::

    from jaxkv import LLM, SamplingParams
    llm = LLM("tiny-llama", kv_cache_memory_bytes=64 << 20)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, temperature=0))
    vecs = llm.embed([[1, 2, 3], [4, 5]])          # one L2-normalised vector per prompt
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxkv.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from jaxkv.engine import LLMEngine
from jaxkv.entrypoints.engine_args import EngineArgs
from jaxkv.interrupts import DeferredInterrupt
from jaxkv.outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxkv.pooling_params import PoolingParams
from jaxkv.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Offline batch generation and pooling, shaped like ``vllm.LLM``.

    Args:
      model: "tiny-llama" | "tiny-hybrid" | "smollm2-135m-instruct" | a local HF checkpoint
        directory (config.json + *.safetensors) | a .gguf file.
      kwargs: the other ``EngineArgs`` fields (what each does:
        :func:`jaxkv.engine_config.resolve_engine_config`); an unknown one is a TypeError.
    """

    def __init__(self, model: str = "tiny-llama", **kwargs):
        engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_config(**engine_args.to_kwargs())

    def shutdown(self) -> None:
        """Stops the engine's workers (a multi-process executor's processes; nothing to stop
        in process). Garbage collection of the ``LLM`` does the same."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """See :meth:`LLMEngine.reset_prefix_cache`."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for ``prompts`` (one prompt or a list); outputs in input order.

        ``priority`` (one int per prompt, lower first) orders the requests when the engine's
        ``scheduling_policy`` is "priority", as vLLM's ``LLM.generate(priority=...)``."""
        prompts = _prompt_list(prompts)
        params = _per_prompt(sampling_params, prompts, SamplingParams, "sampling_params")
        # One output per request, when it finishes (as vLLM's LLM.generate): the engine skips
        # building the per-step outputs nobody reads.
        params = [
            dataclasses.replace(sp or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY)
            for sp in params
        ]
        return self._run(prompts, params, priority, use_tqdm, "generate")

    def encode(
        self,
        prompts,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        *,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pooled hidden states of ``prompts`` (vLLM's ``LLM.encode``): ``pooling_task``
        "embed" (default: one vector per prompt, pooled as the engine's ``pooler_config`` or
        the params say) or "token_embed" (``[num_tokens, hidden]`` per prompt). Each
        ``outputs.data`` is a float32 numpy array of the final-normed hidden states (what the
        LM head reads), after ``dimensions`` truncation and, by default, L2 normalisation.
        Any engine runs these next to generation requests; see :mod:`jaxkv.pooling_params`."""
        prompts = _prompt_list(prompts)
        params = [
            (pp or PoolingParams()).for_task(pooling_task)
            for pp in _per_prompt(pooling_params, prompts, PoolingParams, "pooling_params")
        ]
        if truncate_prompt_tokens is not None:
            params = [
                dataclasses.replace(pp, truncate_prompt_tokens=truncate_prompt_tokens)
                for pp in params
            ]
        return self._run(prompts, params, priority, use_tqdm, "encode")  # the engine resolves them

    def embed(
        self,
        prompts,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's ``LLM.embed``): ``outputs.embedding`` is a list of
        floats. ``encode(..., pooling_task="embed")`` gives the same as numpy arrays."""
        outs = self.encode(
            prompts,
            pooling_params,
            use_tqdm,
            pooling_task="embed",
            truncate_prompt_tokens=truncate_prompt_tokens,
            priority=priority,
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        data_1,
        data_2,
        use_tqdm: bool = True,
        *,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """Cosine similarity of embeddings (vLLM's ``LLM.score`` for embedding models): one
        prompt against one or many (1 -> N), or two lists of the same length pairwise (N -> N).
        Each distinct prompt is embedded once."""
        left, right = _prompt_list(data_1), _prompt_list(data_2)
        if not left or not right:
            raise ValueError("score() needs at least one prompt on each side")
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise ValueError(
                f"score() pairs one prompt with N, or N with N; got {len(left)} and "
                f"{len(right)} prompts"
            )
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(
                f"pooling_params must be PoolingParams, got {type(pooling_params).__name__}"
            )
        keys = [_prompt_key(p) for p in left + right]
        unique = list(dict.fromkeys(keys))
        first = {k: p for k, p in zip(keys, left + right)}
        outs = self.encode(
            [first[k] for k in unique],
            pooling_params,
            use_tqdm,
            pooling_task="embed",
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        by_key = dict(zip(unique, outs))
        scores = []
        for a, b in zip(keys[: len(left)], keys[len(left) :]):
            x, y = by_key[a], by_key[b]
            u, v = np.asarray(x.outputs.data, np.float64), np.asarray(y.outputs.data, np.float64)
            cos = float(u @ v / max(np.linalg.norm(u) * np.linalg.norm(v), 1e-12))
            scores.append(
                ScoringRequestOutput(
                    f"{x.request_id}_{y.request_id}",
                    ScoringOutput(cos),
                    x.prompt_token_ids + y.prompt_token_ids,
                    True,
                )
            )
        return scores

    def _run(self, prompts: list, params: list, priority, use_tqdm: bool, desc: str) -> list:
        """Adds one request per prompt (aborting the ones added when one is refused), steps the
        engine until all finish, and returns their final outputs in input order."""
        engine = self.llm_engine
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        ids: list[str] = []
        finished: dict = {}
        bar = None
        # Ctrl-C is held until the current request is added or the current step is done,
        # then raised here (a second one raises at once): see jaxkv.interrupts.
        with DeferredInterrupt() as interrupt:
            try:
                for p, sp, prio in zip(prompts, params, priorities):
                    rid = engine.next_request_id()
                    ids.append(rid)  # first: add_request cleans up after itself if it raises
                    engine.add_request(rid, p, sp, priority=prio)
                    _raise_if(interrupt)
                bar = _progress(len(ids), desc) if use_tqdm else None
                while len(finished) < len(ids):
                    for out in engine.step():
                        if out.finished and out.request_id in ids:
                            finished[out.request_id] = out
                            if bar is not None:
                                bar.update(1)
                    _raise_if(interrupt)
                    if not engine.has_unfinished_requests() and len(finished) < len(ids):
                        raise RuntimeError(
                            "engine has no unfinished requests but outputs are missing"
                        )
            except BaseException:  # a refused prompt, a failed step, Ctrl-C: this call's
                engine.abort_request(ids)  # requests end with it
                raise
            finally:
                if bar is not None:
                    bar.close()
        return [finished[r] for r in ids]

    def beam_search(
        self, prompts, params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search over ``prompts`` (one or a list: strings, token-id lists or prompt
        dicts), as vLLM's ``LLM.beam_search``; one BeamSearchOutput per prompt, in order, its
        sequences best first (see :mod:`jaxkv.beam_search`). Each round runs the live beams of
        every prompt as one batch of one-token requests; prefix caching reuses their blocks."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        engine = self.llm_engine
        token_lists = [engine.input_processor.tokenize(p)[1] for p in _prompt_list(prompts)]
        k = 2 * params.beam_width
        if k > engine.model_config.vocab_size:
            raise ValueError(
                f"beam_width={params.beam_width} needs 2 * beam_width <= the vocabulary "
                f"({engine.model_config.vocab_size})"
            )
        cap = engine.config.max_logprobs
        if cap != -1 and k > cap:
            raise ValueError(
                f"beam_width={params.beam_width} needs 2 * beam_width = {k} logprobs a round, "
                f"above the engine's max_logprobs={cap}: build the LLM with max_logprobs >= {k}"
            )
        max_len = engine.config.max_model_len
        for i, t in enumerate(token_lists):
            if not t or len(t) >= max_len:
                raise ValueError(
                    f"prompt {i} has {len(t)} tokens; beam search needs 1 .. "
                    f"max_model_len - 1 = {max_len - 1}"
                )
        one = SamplingParams(
            max_tokens=1,
            temperature=params.temperature,
            logprobs=k,
            ignore_eos=True,
            detokenize=False,
        )

        def expand(beams: list[list[int]]) -> list:
            fits = [i for i, t in enumerate(beams) if len(t) < max_len]
            outs = self.generate([beams[i] for i in fits], one, use_tqdm=use_tqdm) if fits else []
            cands: list = [None] * len(beams)
            for i, o in zip(fits, outs):
                cands[i] = o.outputs[0].logprobs[0]
            return cands

        results = run_beam_search(token_lists, params, expand, engine.config.eos_token_ids)
        tok = engine.tokenizer
        if tok is not None:
            for r in results:
                for seq in r.sequences:
                    seq.text = tok.decode(seq.tokens)
        return results

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Renders one conversation (list of {"role", "content"}) or a list of them with the
        model's chat template, then generates."""
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("chat() needs a model with a tokenizer and a chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _raise_if(interrupt: DeferredInterrupt) -> None:
    if interrupt.pending:
        raise KeyboardInterrupt("interrupted (LLM: the requests of this call were aborted)")


def _prompt_list(prompts) -> list:
    """One prompt (a string, a token-id list or a prompt dict) or a list of them -> a list."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)


def _per_prompt(value, prompts: list, cls: type, name: str) -> list:
    """One params object (or None) for every prompt, or a list of one per prompt; TypeError
    naming ``name`` for anything but ``cls`` / None."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != len(prompts):
            raise ValueError(f"{len(value)} {name} for {len(prompts)} prompts")
        params = list(value)
    else:
        params = [value] * len(prompts)
    for p in params:
        if p is not None and not isinstance(p, cls):
            raise TypeError(f"{name} must be {cls.__name__}, got {type(p).__name__}")
    return params


def _prompt_key(prompt):
    """A hashable identity of one prompt (string, token ids or prompt dict)."""
    if isinstance(prompt, dict):
        return tuple(sorted((k, _prompt_key(v)) for k, v in prompt.items()))
    if isinstance(prompt, str):
        return prompt
    return tuple(int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt))


def _progress(total: int, desc: str = "generate"):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)
