"""Real weights offline: HF safetensors directories, GGUF files (dequantized, with their
tokenizer), the embedded SmolLM2-135M-Instruct GGUF, and orbax save/restore of parameters."""

from jaxkv.models.checkpoint.gguf_reader import GGUFTensors, read_gguf, read_gguf_metadata
from jaxkv.models.checkpoint.gguf_tokenizer import tokenizer_from_gguf_metadata
from jaxkv.models.checkpoint.orbax_io import read_saved_config, restore_params, save_params
from jaxkv.models.checkpoint.safetensors_dir import (
    SafetensorsTensors,
    read_safetensors_dir,
    write_safetensors_dir,
)
from jaxkv.models.checkpoint.smollm2 import SMOLLM2_NAME, cache_dir, smollm2_gguf_path
from jaxkv.models.checkpoint.tensors import CheckpointTensors, InMemoryTensors

__all__ = [
    "CheckpointTensors",
    "GGUFTensors",
    "InMemoryTensors",
    "SafetensorsTensors",
    "SMOLLM2_NAME",
    "cache_dir",
    "read_gguf",
    "read_gguf_metadata",
    "read_safetensors_dir",
    "read_saved_config",
    "restore_params",
    "save_params",
    "smollm2_gguf_path",
    "tokenizer_from_gguf_metadata",
    "write_safetensors_dir",
]
