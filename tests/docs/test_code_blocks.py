"""Every fenced code block of README.md and docs/*.md is checked.

- ```python: executed with a fresh namespace (``<!-- slow -->`` before it marks it slow).
- ```bash: each ``jaxkv ...`` command is parsed by jaxkv's own argument parser (not run);
  ``python -m pytest``, ``python FILE``, ``pip install`` and script paths must name files,
  folders and extras that exist.
- ```text: not code (diagrams, outlines).
- ``<!-- run by PATH -->`` before a block: PATH is a test that runs it (it must exist and name
  the document); a python block is still compiled here.
- ``<!-- not run: REASON -->`` before a block: skipped; a few at most, each with a reason.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGS = ("python", "bash", "text")
MAX_NOT_RUN = 3

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
ASSIGN = re.compile(r"^[A-Za-z_]\w*=")
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;", "|&"}


@dataclasses.dataclass
class Block:
    doc: pathlib.Path
    line: int
    lang: str
    code: str
    note: str  # the HTML comment right before the block, "" if none

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def extract(doc: pathlib.Path, text: str | None = None) -> list[Block]:
    text = doc.read_text() if text is None else text
    blocks = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip()
        note = before[before.rfind("<!--") + 4 : -3].strip() if before.endswith("-->") else ""
        blocks.append(
            Block(
                doc=doc,
                line=text.count("\n", 0, m.start()) + 1,
                lang=m.group(1).strip(),
                code=m.group(2),
                note=note,
            )
        )
    return blocks


ALL = [b for d in DOCS for b in extract(d)]


def _by(lang: str, *, run: bool):
    out = []
    for b in ALL:
        if b.lang != lang or b.note.startswith("not run"):
            continue
        if run and b.note.startswith("run by"):
            continue
        marks = [pytest.mark.slow] if run and b.note == "slow" else []
        out.append(pytest.param(b, id=b.id, marks=marks))
    return out


# ---- the document set and its annotations -------------------------------------------------------


def test_docs_have_blocks_and_every_block_a_language():
    assert len(DOCS) >= 10 and len(ALL) >= 20, [d.name for d in DOCS]
    bad = [b.id for b in ALL if b.lang not in LANGS]
    assert not bad, f"fenced blocks need a language among {LANGS}: {bad}"


def test_annotations_are_known():
    known = re.compile(r"^(|slow|run by \S+|not run: .{10,})$", re.S)
    bad = [(b.id, b.note) for b in ALL if not known.match(b.note)]
    assert not bad, f"unknown or reason-less block comments: {bad}"


def test_not_run_blocks_are_few_and_give_a_reason():
    skipped = [b for b in ALL if b.note.startswith("not run")]
    assert len(skipped) <= MAX_NOT_RUN, [(b.id, b.note) for b in skipped]
    for b in skipped:
        assert len(b.note.split(":", 1)[1].split()) >= 3, (b.id, b.note)


@pytest.mark.parametrize(
    "block", [b for b in ALL if b.note.startswith("run by")], ids=lambda b: b.id
)
def test_run_by_names_a_test_that_reads_the_document(block):
    path = ROOT / block.note.split()[-1]
    assert path.is_file(), f"{block.id}: {path} does not exist"
    assert block.doc.name in path.read_text(), f"{block.id}: {path} never names {block.doc.name}"


def test_the_two_commands_are_in_the_readme():
    """.ci/run runs the README's test command; the README keeps both of its commands."""
    bash = [b.code for b in extract(ROOT / "README.md") if b.lang == "bash"]
    assert any(c.rstrip().endswith("&& jaxkv generate") for c in bash)
    assert any('python -m pytest -q -n 2 --dist loadfile -m "not gpu_aot_full"' in c for c in bash)


# ---- python blocks -----------------------------------------------------------------------------


@pytest.mark.parametrize("block", _by("python", run=False))
def test_python_block_compiles(block):
    compile(block.code, block.id, "exec")


@pytest.mark.parametrize("block", _by("python", run=True))
def test_python_block_runs(block):
    exec(compile(block.code, block.id, "exec"), {"__name__": "__docs__"})


# ---- bash blocks -------------------------------------------------------------------------------


def commands(code: str) -> list[list[str]]:
    """The simple commands of a bash block: lines joined at ``\\``, split at operators
    (quotes respected), comments and leading ``VAR=value`` words dropped, variables assigned in
    the block (``P='...'``) substituted."""
    code = code.replace("\\\n", " ")
    env = dict(re.findall(r"^([A-Za-z_]\w*)='([^']*)'\s*$", code, re.M))
    out = []
    for line in code.splitlines():
        for name, value in env.items():
            line = line.replace(f'"${name}"', shlex.quote(value))
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words: list[str] = []
        for tok in [*lex, ";"]:
            if tok in OPERATORS:
                while words and ASSIGN.match(words[0]):
                    words.pop(0)
                if words:
                    out.append(words)
                words = []
            else:
                words.append(tok)
    return out


def _extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def check_command(words: list[str]) -> None:
    """Raises AssertionError (or SystemExit from the parser) when a command is wrong."""
    prog, args = words[0], words[1:]
    if prog == "jaxkv":
        from jaxkv.entrypoints.cli import build_parser

        build_parser().parse_args(args)  # exits 2 on an unknown command or flag, a bad value
    elif re.fullmatch(r"python[\d.]*", prog):
        if args[:2] == ["-m", "pytest"]:
            for a in args[2:]:
                if not a.startswith("-") and ("/" in a or a.endswith(".py")):
                    assert (ROOT / a.split("::")[0]).exists(), f"no {a}"
        elif args and args[0] == "-m":
            assert args[1] in ("venv", "pip", "jaxkv.executor.headless", "pytest"), args
        elif args and args[0] != "-c":
            assert (ROOT / args[0]).is_file(), f"no {args[0]}"
    elif prog == "pip" and args[:1] == ["install"]:
        for a in args[1:]:
            m = re.fullmatch(r"(\.[^\[]*)(?:\[([\w,-]+)\])?", a)
            if m:  # a local path, perhaps with extras
                assert (ROOT / m.group(1)).exists(), f"no {m.group(1)}"
                assert set((m.group(2) or "").split(",")) - {""} <= _extras(), f"extras of {a}"
    elif "/" in prog and not prog.startswith(("/", "$", "~")):
        assert (ROOT / prog).is_file(), f"no {prog}"


@pytest.mark.parametrize("block", _by("bash", run=False))
def test_bash_block_commands(block):
    cmds = commands(block.code)
    assert cmds, f"{block.id}: no command"
    for words in cmds:
        try:
            check_command(words)
        except SystemExit as e:
            pytest.fail(f"{block.id}: {' '.join(words)!r} does not parse (exit {e.code})")
        except AssertionError as e:
            pytest.fail(f"{block.id}: {' '.join(words)!r}: {e}")


# ---- the checks can fail -----------------------------------------------------------------------


def test_a_broken_block_fails_the_checks():
    doc = ROOT / "docs" / "example.md"
    text = (
        "```bash\njaxkv generate --no-such-flag\n```\n\n"
        "```bash\npython -m pytest -q tests/no_such_dir\n```\n\n"
        '```bash\npip install -e ".[no_such_extra]"\n```\n\n'
        "```python\nraise RuntimeError('broken')\n```\n\n"
        "<!-- not run: -->\n```python\npass\n```\n\n```\nuntagged\n```\n"
    )
    blocks = extract(doc, text)
    assert [b.lang for b in blocks] == ["bash", "bash", "bash", "python", "python", ""]
    with pytest.raises(SystemExit):
        check_command(commands(blocks[0].code)[0])
    for b in blocks[1:3]:
        with pytest.raises(AssertionError):
            check_command(commands(b.code)[0])
    with pytest.raises(RuntimeError):
        exec(compile(blocks[3].code, "x", "exec"), {})
    assert blocks[4].note == "not run:" and not re.match(r"not run: .{10,}", blocks[4].note)
    assert commands('P=\'{"a": 1}\'\nX=1 jaxkv serve --kv-transfer-config "$P" &  # c\n') == [
        ["jaxkv", "serve", "--kv-transfer-config", '{"a": 1}']
    ]
