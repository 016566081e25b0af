"""Pooling (embedding) parameters, with vLLM's names (no jax import).

A pooling request runs its prompt through the model and returns hidden states instead of
tokens: ``LLM.embed`` / ``LLM.encode`` / ``LLM.score``, or ``LLMEngine.add_request`` with a
``PoolingParams``. The hidden states are the model's final-normed ones (what the LM head
reads), pooled on the device per step and finished on the host.

Tasks (vLLM's):
  * ``"embed"``: one vector per prompt, pooled by ``pooling_type``.
  * ``"token_embed"``: one vector per prompt token (``ALL`` pooling), ``[num_tokens, hidden]``.

Pooling types (vLLM's ``PoolerConfig.pooling_type``):
  * ``"LAST"``: the last prompt token's hidden state (vLLM's default for decoder-only models).
  * ``"MEAN"``: the mean over every prompt token.
  * ``"CLS"``: the first prompt token's.
  * ``"ALL"``: every prompt token's (``token_embed``).
"""

from __future__ import annotations

import dataclasses

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
POOLING_TASKS = ("embed", "token_embed")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(name: str, value) -> str:
    if not isinstance(value, str) or value.upper() not in POOLING_TYPES:
        raise ValueError(f"{name} must be one of {POOLING_TYPES}, got {value!r}")
    return value.upper()


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """The engine's pooling defaults (vLLM's ``PoolerConfig``): ``LLM(..., pooler_config=...)``.

    Attributes:
        pooling_type: How ``"embed"`` pools a prompt's hidden states (see the module doc).
        normalize: L2-normalise each returned vector (vLLM's default for embedding models).
    """

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self):
        pt = _check_type("pooling_type", self.pooling_type)
        if pt == "ALL":
            raise ValueError(
                "pooling_type 'ALL' is the 'token_embed' task, not an engine default; "
                "use one of LAST, MEAN, CLS"
            )
        object.__setattr__(self, "pooling_type", pt)
        if not isinstance(self.normalize, bool):
            raise TypeError(f"normalize must be a bool, got {self.normalize!r}")


@dataclasses.dataclass
class PoolingParams:
    """Per-request pooling parameters (vLLM's ``PoolingParams`` subset, plus ``pooling_type``).

    Attributes:
        task: ``"embed"`` or ``"token_embed"``; None: set by the call (``embed`` / ``encode``),
            ``"embed"`` through ``LLMEngine.add_request``.
        dimensions: Keep the first ``dimensions`` features (Matryoshka truncation, before
            normalising); None keeps the model's hidden size.
        normalize: L2-normalise the result; None takes the engine's ``PoolerConfig``.
        pooling_type: ``"LAST"`` / ``"MEAN"`` / ``"CLS"`` for ``"embed"`` (a jaxkv extension:
            vLLM fixes it per model); None takes the engine's ``PoolerConfig``.
        truncate_prompt_tokens: Keep only the prompt's last k tokens (k >= 1), -1 the most that
            fit (``max_model_len - 1``, as for ``SamplingParams``); None keeps the whole prompt.
    """

    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(
                f"pooling task must be one of {POOLING_TASKS} (this engine has no "
                f"classification or reward head), got {self.task!r}"
            )
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an int >= 1, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise TypeError(f"normalize must be a bool or None, got {self.normalize!r}")
        if self.pooling_type is not None:
            self.pooling_type = _check_type("pooling_type", self.pooling_type)
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens)
            or self.truncate_prompt_tokens == 0
            or self.truncate_prompt_tokens < -1
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be an int >= 1 or -1, "
                f"got {self.truncate_prompt_tokens!r}"
            )
        if self.task == "token_embed" and self.pooling_type not in (None, "ALL"):
            raise ValueError(
                f"task 'token_embed' pools every token (ALL), got pooling_type "
                f"{self.pooling_type!r}"
            )
        if self.task == "embed" and self.pooling_type == "ALL":
            raise ValueError(
                "task 'embed' returns one vector; pooling_type 'ALL' is task 'token_embed'"
            )

    def for_task(self, task: str | None) -> PoolingParams:
        """A copy for a call of ``task`` (``LLM.encode`` / ``embed``): ValueError when the params
        name another task."""
        if self.task is not None and task is not None and task != self.task:
            raise ValueError(f"PoolingParams(task={self.task!r}) passed to a {task!r} call")
        return dataclasses.replace(self, task=self.task or task)

    def resolved(self, config: PoolerConfig, hidden_size: int) -> PoolingParams:
        """A copy with every None filled from ``config`` (task: "embed"), checked against the
        model (``dimensions <= hidden_size``). The engine stores this copy."""
        task = self.task or "embed"
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(
                f"dimensions={self.dimensions} is more than the model's hidden size {hidden_size}"
            )
        pt = "ALL" if task == "token_embed" else (self.pooling_type or config.pooling_type)
        return dataclasses.replace(
            self,
            task=task,
            pooling_type=pt,
            normalize=config.normalize if self.normalize is None else self.normalize,
        )

    @property
    def needs_every_token(self) -> bool:
        """MEAN, CLS and ALL read every prompt token's hidden state, so the request cannot
        take prefix-cache hits (its cached tokens would not be run); LAST can (the last
        prompt token is always run)."""
        return self.pooling_type not in (None, "LAST")
