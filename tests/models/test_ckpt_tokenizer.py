"""The byte-level BPE tokenizer stored in GGUF metadata, and chat templates."""

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_fixtures import CHAT_TEMPLATE, bpe_vocab, hf_config_dict, small_config, write_llama_gguf

from jaxkv.models.checkpoint import read_gguf, read_gguf_metadata, tokenizer_from_gguf_metadata
from jaxkv.models.tokenizer import ChatTemplateError, Tokenizer

CFG = hf_config_dict(small_config())
TENSORS = {
    "model.embed_tokens.weight": np.zeros((CFG["vocab_size"], CFG["hidden_size"]), np.float32)
}


def _tokenizer(tmp_path, **kw) -> Tokenizer:
    write_llama_gguf(tmp_path / "t.gguf", CFG, TENSORS, **kw)
    return tokenizer_from_gguf_metadata(
        read_gguf_metadata(gguf.GGUFReader(str(tmp_path / "t.gguf")))
    )


def test_encode_decode_roundtrip(tmp_path):
    tok = _tokenizer(tmp_path)
    tokens, _ = bpe_vocab()
    assert tok.vocab_size == len(tokens)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    ids = tok.encode("hello the world")
    # BPE merges in rank order: "h e" before "l l"; "Ġ t" then "Ġt he"; "Ġ w" then "Ġw or".
    assert [tokens[i] for i in ids] == ["he", "ll", "o", "Ġthe", "Ġwor", "l", "d"]
    for text in ["hello the world", "héllo, wörld!\n\t  x", "12 + 3 = 15", "日本語 🙂"]:
        assert tok.decode(tok.encode(text)) == text


def test_specials_and_digits(tmp_path):
    tok = _tokenizer(tmp_path)
    tokens, _ = bpe_vocab()
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # specials are atomic, never split into bytes
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"
    # "smollm" pre-tokenizer: every digit alone even though the merge "1 2" exists.
    assert [tokens[i] for i in tok.encode("12")] == ["1", "2"]
    gpt2 = _tokenizer(tmp_path, pre="gpt2")
    assert [tokens[i] for i in gpt2.encode("12")] == ["12"]


def test_add_bos_token(tmp_path):
    tok = _tokenizer(tmp_path, add_bos=True)
    assert tok.encode("hello")[0] == 1
    assert tok.encode("hello", add_special_tokens=False)[0] != 1
    assert _tokenizer(tmp_path, add_bos=False).encode("hello")[0] != 1


def test_chat_template_renders_and_raises(tmp_path):
    pytest.importorskip("jinja2")
    tok = _tokenizer(tmp_path)
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "assistant\n"
    )
    assert tok.encode(text)[0] == 1
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_save_and_hf_dir_roundtrip(tmp_path):
    tok = _tokenizer(tmp_path)
    tok.save(tmp_path / "hf")
    back = Tokenizer.from_hf_dir(tmp_path / "hf")
    assert (back.bos_token_id, back.eos_token_id, back.chat_template) == (1, 2, CHAT_TEMPLATE)
    text = "<|im_start|>hello the world 12<|im_end|>"
    assert back.encode(text) == tok.encode(text)
    assert Tokenizer.from_hf_dir(tmp_path / "nothing-here") is None


def test_read_gguf_returns_tokenizer_and_errors(tmp_path):
    write_llama_gguf(tmp_path / "t.gguf", CFG, TENSORS, pre="made-up")
    with pytest.raises(ValueError, match="pre-tokenizer 'made-up'"):
        read_gguf(tmp_path / "t.gguf")
    write_llama_gguf(tmp_path / "n.gguf", CFG, TENSORS, with_tokenizer=False)
    assert read_gguf(tmp_path / "n.gguf")[2] is None
