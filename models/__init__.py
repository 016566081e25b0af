"""Flax NNX models with a functional paged-KV forward.

Families: "llama" (Llama 2/3, Mistral, Qwen2, Qwen3), "gemma2" (hybrid local/global
attention with soft-capping) and "gemma3" (five local layers to one global, q/k norm, a
local RoPE base). Public surface:

  config:   ModelConfig, RopeScaling, LayerKVInfo, KVCacheBinding, get_config,
            layer_name
  models:   build_model, LlamaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, CausalLM
            model(input_ids [T], positions [T], kv_buffers, attn_metadata, binding)
                -> (hidden [T, hidden] after the final norm, new kv_buffers)
            model.compute_logits(hidden [R, hidden]) -> [R, V] float32
            model.compute_logits(hidden [R, hidden], vocab_major=True) -> [V, R] float32
            model.float_lm_head() -> [V, hidden] | None (optional: logits are hidden @ W^T)
            model.kv_layer_infos() -> {layer_name: LayerKVInfo}
            model.config: vocab_size, head_dim, max_position_embeddings, dtype, eos_token_id
  layers:   attend_paged (one attention layer's paged step: write K/V, attend; what a model of
            your own calls, see docs/models.md, "A model of your own")
  weights:  load_hf_weights, hf_state_dict
  sharding: tensor parallelism: DEFAULT_TP_RULES (parameter name -> split), IF_DIVISIBLE,
            make_tp_mesh, shard_state; a model may set ``tp_partition_rules``
  loading:  load_model (mesh=: parameters created shard by shard), load_model_config
  testing:  dense_forward (non-paged reference, [Bt, L] -> [Bt, L, V])
"""

from jaxkv.models.attention import attend_paged
from jaxkv.models.build import MODEL_CLASSES, build_model
from jaxkv.models.config import (
    KVCacheBinding,
    LayerKVInfo,
    ModelConfig,
    RopeScaling,
    get_config,
    layer_name,
)
from jaxkv.models.dense_reference import dense_forward, dense_hidden
from jaxkv.models.hf_config import SUPPORTED_MODEL_TYPES, config_from_hf
from jaxkv.models.hybrid import Gemma2ForCausalLM, Gemma3ForCausalLM
from jaxkv.models.llama import LlamaForCausalLM
from jaxkv.models.sharding import DEFAULT_TP_RULES, IF_DIVISIBLE, make_tp_mesh, shard_state
from jaxkv.models.transformer import CausalLM
from jaxkv.models.weights import hf_state_dict, load_hf_weights

__all__ = [
    "config_from_hf",
    "CausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "attend_paged",
    "KVCacheBinding",
    "LayerKVInfo",
    "LlamaForCausalLM",
    "MODEL_CLASSES",
    "ModelConfig",
    "RopeScaling",
    "SUPPORTED_MODEL_TYPES",
    "build_model",
    "dense_forward",
    "dense_hidden",
    "get_config",
    "hf_state_dict",
    "layer_name",
    "load_hf_weights",
    "DEFAULT_TP_RULES",
    "IF_DIVISIBLE",
    "make_tp_mesh",
    "shard_state",
]

# Checkpoints, tokenizer and the name/path loader.
from jaxkv.models.registry import BUILTIN_NAMES, load_model, load_model_config
from jaxkv.models.tokenizer import Tokenizer

__all__ += ["BUILTIN_NAMES", "Tokenizer", "load_model", "load_model_config"]
