"""A thin tokenizer: a `tokenizers.Tokenizer` plus special ids and a Jinja chat template.

Built from an HF directory (``tokenizer.json`` + ``tokenizer_config.json``) or from GGUF
metadata (``jaxkv.models.checkpoint.gguf_tokenizer``). Chat templates are rendered the way
transformers renders them: a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, a ``raise_exception`` helper, and the special tokens as variables.
jinja2 is imported only when a template is rendered.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers


class ChatTemplateError(ValueError):
    """Raised by a chat template through ``raise_exception(message)``."""


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """Text <-> token ids.

    Attributes:
      backend: the `tokenizers.Tokenizer` doing the work (its post-processor decides whether
        ``encode(..., add_special_tokens=True)`` prepends BOS).
      bos_token_id / eos_token_id / pad_token_id: special ids, None when the model has none.
      chat_template: Jinja source, None when the model ships none.
    """

    backend: tokenizers.Tokenizer
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None

    def __post_init__(self):
        if not isinstance(self.backend, tokenizers.Tokenizer):
            raise TypeError(
                f"backend must be a tokenizers.Tokenizer, got {type(self.backend).__name__}"
            )
        n = self.backend.get_vocab_size(with_added_tokens=True)
        for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, field)
            if value is not None and not 0 <= value < n:
                raise ValueError(f"{field}={value} is outside the vocabulary [0, {n})")

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Renders ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the template.

        Extra keyword arguments become template variables (as in transformers).

        Raises:
          ValueError: no chat template; ChatTemplateError when the template raises.
          ImportError: jinja2 is not installed.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("messages must be a list of dicts with 'role' and 'content'")
        template = _compile_template(self.chat_template)
        special = {
            "bos_token": self._token_or_empty(self.bos_token_id),
            "eos_token": self._token_or_empty(self.eos_token_id),
            "pad_token": self._token_or_empty(self.pad_token_id),
        }
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **{**special, **kwargs}
        )

    def _token_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.id_to_token(token_id) or "")

    def save(self, path: str | os.PathLike) -> Path:
        """Writes ``tokenizer.json`` + ``tokenizer_config.json`` (HF layout) into directory
        ``path``; ``Tokenizer.from_hf_dir(path)`` reads them back."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(root / "tokenizer.json"))
        cfg: dict[str, Any] = {"chat_template": self.chat_template}
        for name in ("bos", "eos", "pad"):
            token_id = getattr(self, f"{name}_token_id")
            cfg[f"{name}_token"] = None if token_id is None else self.id_to_token(token_id)
        with open(root / "tokenizer_config.json", "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)
        return root

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Loads a ``tokenizer.json``."""
        if not Path(path).is_file():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist")
        return cls(
            tokenizers.Tokenizer.from_file(str(path)),
            bos_token_id,
            eos_token_id,
            pad_token_id,
            chat_template,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer | None:
        """Loads ``tokenizer.json`` of an HF directory, None when there is none.

        Special tokens and the chat template come from ``tokenizer_config.json`` (or
        ``chat_template.jinja``), ids falling back to ``config.json`` / ``generation_config.json``.
        """
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            return None
        backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        tok_cfg = _read_json(root / "tokenizer_config.json")
        model_cfg = {
            **_read_json(root / "config.json"),
            **_read_json(root / "generation_config.json"),
        }

        def special_id(name: str) -> int | None:
            token = tok_cfg.get(f"{name}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str) and backend.token_to_id(token) is not None:
                return backend.token_to_id(token)
            value = model_cfg.get(f"{name}_token_id")
            if isinstance(value, list):
                value = value[0] if value else None
            return None if value is None else int(value)

        template = tok_cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            by_name = {t.get("name"): t.get("template") for t in template}
            template = by_name.get("default")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(backend, special_id("bos"), special_id("eos"), special_id("pad"), template)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str):
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("rendering chat templates needs jinja2: pip install jinja2") from e

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
