"""Model configuration, per-layer KV-cache facts, and the KV-cache binding of a step.

``ModelConfig`` covers three families:
  * "llama": Llama 2/3, Mistral, Qwen2, Qwen3 (RMSNorm, RoPE, GQA, gated MLP; optional q/k/v
    bias, per-head q/k RMSNorm, sliding window on some or all layers).
  * "gemma2": alternating local (sliding-window) / global layers, attention and final logit
    soft-capping, pre- and post- norms with (1 + weight) RMSNorm, embeddings scaled by
    sqrt(hidden), sm_scale = query_pre_attn_scalar ** -0.5, GeGLU MLP, tied embeddings.
  * "gemma3": Gemma 2's layer and norms without soft-capping, plus per-head q/k (1 + weight)
    RMSNorm, five local layers to one global by default (``sliding_window_pattern`` 6), and
    local layers' own RoPE base (``rope_local_base_freq``, no scaling).

Configs are frozen and hashable (they sit in the static part of an ``nnx.split`` graphdef).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ARCHITECTURES = ("llama", "gemma2", "gemma3")
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
DTYPES = ("float32", "bfloat16")
ROPE_TYPES = ("default", "linear", "llama3")
CACHE_DTYPES = ("float32", "bfloat16", "float16", "fp8")
BACKENDS = ("xla", "cpu", "pallas", "reference")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_scaling``): "linear" divides every inverse frequency by
    ``factor``; "llama3" divides low frequencies by ``factor``, keeps high ones, and interpolates
    between ``low_freq_factor`` and ``high_freq_factor`` (wavelengths measured against
    ``original_max_position_embeddings``)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {self.rope_type!r}; supported: {ROPE_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope_scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RopeScaling:
        """From an HF ``rope_scaling`` / ``rope_parameters`` dict ("type" is the old key name)."""
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r} in {dict(d)}; supported: {ROPE_TYPES}"
            )
        kw: dict[str, Any] = {"rope_type": rope_type}
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if d.get(name) is not None:
                kw[name] = float(d[name])
        if d.get("original_max_position_embeddings") is not None:
            kw["original_max_position_embeddings"] = int(d["original_max_position_embeddings"])
        if rope_type == "llama3":
            missing = [
                n
                for n in (
                    "factor",
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                )
                if d.get(n) is None
            ]
            if missing:
                raise ValueError(f"llama3 rope_scaling is missing {missing}: {dict(d)}")
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters (HF ``config.json`` names) plus the parameter dtype.

    ``layer_types`` defaults to all "full_attention" for "llama" without ``sliding_window``,
    all "sliding_attention" for "llama" with one (Mistral), and sliding on even layers for
    "gemma2" (layer 0 local, layer 1 global, ..., as HF Gemma 2).
    ``attention_bias`` adds biases to q/k/v; ``attention_out_bias`` to o_proj (Llama's
    ``attention_bias`` sets both, Qwen2 only the first).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_base_freq: float | None = None  # gemma3: sliding layers' RoPE base (no scaling)
    hidden_act: str = "silu"
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, "
                f"{self.rope_theta}"
            )
        if isinstance(self.rope_scaling, Mapping):
            set_("rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"rope_scaling must be a RopeScaling, a dict or None, got {self.rope_scaling!r}"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise ValueError(
                f"sliding_window must be a positive int or None, got {self.sliding_window!r}"
            )
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        self._init_layer_types()
        self._check_family()

    def _init_layer_types(self):
        n = self.num_hidden_layers
        types = self.layer_types
        if types is None:
            if self.architecture == "gemma2":
                types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
            elif self.architecture == "gemma3":  # HF's default sliding_window_pattern 6
                types = [
                    "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
                ]
            else:
                kind = "sliding_attention" if self.sliding_window else "full_attention"
                types = [kind] * n
        types = tuple(types)
        if len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types must be {n} entries from {LAYER_TYPES}, got {types}")
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError(f"layer_types has sliding layers but sliding_window is None: {types}")
        object.__setattr__(self, "layer_types", types)

    def _check_family(self):
        for name in (
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "query_pre_attn_scalar",
            "rope_local_base_freq",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if self.is_gemma:
            if self.query_pre_attn_scalar is None:
                raise ValueError(
                    f"{self.architecture} needs query_pre_attn_scalar (sm_scale = its ** -0.5)"
                )
            if self.architecture == "gemma2" and self.qk_norm:
                raise ValueError("gemma2 has no q/k norm (qk_norm=True is a Gemma 3 feature)")
            if self.architecture == "gemma3" and not self.qk_norm:
                raise ValueError("gemma3 has a q/k norm (qk_norm must be True)")
        elif self.attn_logit_softcapping is not None or self.final_logit_softcapping is not None:
            raise ValueError(
                f"soft-capping is a Gemma feature; architecture={self.architecture!r} got "
                f"attn={self.attn_logit_softcapping}, final={self.final_logit_softcapping}"
            )
        if self.rope_local_base_freq is not None and self.architecture != "gemma3":
            raise ValueError(
                f"rope_local_base_freq is a gemma3 feature; architecture={self.architecture!r}"
            )

    @property
    def is_gemma(self) -> bool:
        """Gemma 2 / 3: (1 + weight) RMSNorms, sandwich norms, embeddings scaled by sqrt(hidden)."""
        return self.architecture in ("gemma2", "gemma3")

    def layer_rope(self, i: int) -> tuple[float, RopeScaling | None]:
        """Layer ``i``'s RoPE base and scaling: a gemma3 sliding layer's own base, unscaled;
        otherwise ``rope_theta`` and ``rope_scaling``."""
        if self.architecture == "gemma3" and self.layer_types[i] == "sliding_attention":
            return (
                self.rope_local_base_freq if self.rope_local_base_freq is not None else 10000.0
            ), None
        return self.rope_theta, self.rope_scaling

    # ---- derived per-layer facts -------------------------------------------------------------
    def layer_window(self, i: int) -> int | None:
        """Sliding window of layer ``i`` (query p attends keys in (p - W, p]) or None (full)."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @property
    def sm_scale(self) -> float:
        """Softmax scale: query_pre_attn_scalar ** -0.5 when set (Gemma 2), else head_dim ** -0.5."""
        base = (
            self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        )
        return float(base) ** -0.5


@dataclasses.dataclass(frozen=True)
class LayerKVInfo:
    """What the engine needs to size one attention layer's KV cache."""

    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None


@dataclasses.dataclass(frozen=True)
class KVCacheBinding:
    """Static map from attention layers to KV-cache groups and tensors, built once by the engine.

    ``layers[j] = (layer_name, group_index, tensor_index)``: the layer reads the attention
    metadata ``attn_metadata[group_index]`` and writes the buffer ``kv_buffers[tensor_index]``.
    Example (Gemma 2, 4 layers, group 0 = full, group 1 = sliding, tensor i shared by layer i
    of each group): layers = (("model.layers.0.self_attn", 1, 0), ("model.layers.1.self_attn", 0, 0),
    ("model.layers.2.self_attn", 1, 1), ("model.layers.3.self_attn", 0, 1)).
    Hashable: pass it as a static argument of the jitted step.

    ``mesh`` (a ``jax.sharding.Mesh`` with a ``"tp"`` axis, or None on one device): under
    tensor parallelism every KV buffer is split over ``"tp"`` by KV heads (each device's shard
    is a flat buffer of its own heads' pages) and ``attend_paged`` runs once per device.
    """

    layers: tuple[tuple[str, int, int], ...]
    block_size: int
    cache_dtype: str = "float32"
    backend: str = "xla"
    interpret: bool = False
    k_scale: float | None = None
    v_scale: float | None = None
    mesh: Any = None

    def __post_init__(self):
        layers = tuple((str(n), int(g), int(t)) for n, g, t in self.layers)
        object.__setattr__(self, "layers", layers)
        names = [n for n, _, _ in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate layer names in KVCacheBinding: {names}")
        if any(g < 0 or t < 0 for _, g, t in layers):
            raise ValueError(f"group and tensor indices must be >= 0: {layers}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {self.cache_dtype!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.cache_dtype != "fp8" and (self.k_scale is not None or self.v_scale is not None):
            raise ValueError(f"k_scale/v_scale need cache_dtype='fp8', got {self.cache_dtype!r}")

    @property
    def cpu_kernels(self) -> bool:
        """Whether the KV write and page zeroing go through the C++ kernels (backend "cpu";
        they fall back to XLA where the kernels do not run)."""
        return self.backend == "cpu"

    def lookup(self, layer_name: str) -> tuple[int, int]:
        """(group_index, tensor_index) of ``layer_name``; KeyError names the known layers."""
        for name, group, tensor in self.layers:
            if name == layer_name:
                return group, tensor
        raise KeyError(
            f"layer {layer_name!r} is not in the KV-cache binding "
            f"(bound: {[n for n, _, _ in self.layers]})"
        )


def layer_name(i: int) -> str:
    """KV-cache name of decoder layer ``i``'s attention (as vLLM: the module path)."""
    return f"model.layers.{i}.self_attn"


_TINY = {
    "tiny-llama": dict(
        architecture="llama",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tiny-hybrid": dict(
        architecture="gemma2",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        sliding_window=128,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=64.0,
        hidden_act="gelu_pytorch_tanh",
        bos_token_id=2,
        eos_token_id=1,
    ),
}


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """A named tiny config ("tiny-llama", "tiny-hybrid"), with optional field overrides."""
    if name not in _TINY:
        raise ValueError(f"unknown config {name!r}; known: {sorted(_TINY)}")
    return ModelConfig(**{**_TINY[name], **overrides})
