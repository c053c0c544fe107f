"""Every code block in README.md and docs/*.md runs as written (the convention is in docs/testing.md,
"Code blocks in the docs").

* ```python blocks run as scripts (``__name__ == "__main__"``) on workers of the test harness's pools
  (process group initialised, launcher variables set, a temporary working directory shared by the
  ranks). Words after the language say how: ``ranks=N`` (N ranks; default 1), ``framework=mindspore``
  (MindSpore workers), ``continues`` (appended to the file's previous python block: the chain runs
  once, as one program), ``file=PATH`` (an excerpt: its lines must appear in PATH),
  ``tested-by=TEST`` (a step of a worked example that TEST, which reads this doc, runs in context),
  ``norun=REASON`` (REASON from NORUN: hardware this machine lacks, or a block that must be a
  process of its own; the block must still parse).
* ```bash blocks and inline `commands` are not run (they install, build environments or run for
  minutes); each command is checked instead: the module / script / file it names exists (or is a
  script a python block of the same doc says to save), every ``--flag`` is one its ``--help``
  lists, every pip extra is in pyproject.toml, msrun waits for its workers (``--join True``).
* Blocks with no language are output and are not checked.
"""
import ast
import functools
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from tests.cases import doc_snippet
from tests.harness.frameworks import run_on

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NORUN = {"npu": "needs an Ascend NPU with CANN and torch_npu",
         # the dry run makes its process rank r of N on PyTorch's fake backend: a worker of the pools
         # already has a process group (tests/test_plan_*.py run dry_run in processes of their own)
         "own-process": "initialises a process group of its own (the dry run's fake backend)"}
TIMEOUT_S = 300
_FENCE = re.compile(r"^```(\w*)[ \t]*(.*)$")
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_COMMAND_START = ("python ", "python3 ", "torchrun ", "msrun ", "pip ", "bash ", "HP_PLATFORM=", ".venv-ms/")


class Block:
    def __init__(self, path, line, lang, info, code):
        self.path, self.line, self.lang, self.code = path, line, lang, code
        self.attrs = dict(w.split("=", 1) if "=" in w else (w, True) for w in shlex.split(info))

    @property
    def where(self):
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path):
    """The fenced blocks of a markdown file, in order."""
    lines = path.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        out.append(Block(path, i + 1, m.group(1), m.group(2), "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return out


def _python_blocks():
    return [b for path in DOCS for b in blocks(path) if b.lang == "python"]


def chains():
    """Runnable python programs: a block plus the blocks that continue it."""
    out = []
    for b in _python_blocks():
        if {"file", "norun", "tested-by"} & set(b.attrs):
            continue
        if "continues" in b.attrs:
            if not out or out[-1][0].path != b.path:
                raise ValueError(f"{b.where}: 'continues' but no python block before it in this file")
            out[-1].append(b)
        else:
            out.append([b])
    return out


# ---------------------------------------------------------------------------------------- python
def test_every_python_block_compiles_and_names_a_known_mode():
    known = {"ranks", "framework", "continues", "file", "norun", "tested-by"}
    for b in _python_blocks():
        assert set(b.attrs) <= known, f"{b.where}: unknown words {set(b.attrs) - known} (known: {known})"
        assert b.attrs.get("norun", "npu") in NORUN, f"{b.where}: norun={b.attrs['norun']} not in {NORUN}"
        if "file" not in b.attrs and "tested-by" not in b.attrs:
            ast.parse(b.code, filename=b.where)


def _lines(text):
    return "\n".join(line.strip() for line in text.strip("\n").split("\n"))


@pytest.mark.parametrize("block", [b for b in _python_blocks() if "file" in b.attrs], ids=lambda b: b.where)
def test_excerpt_is_in_its_file(block):
    text = (ROOT / block.attrs["file"]).read_text()
    where = block.attrs["file"]
    assert _lines(block.code) in _lines(text), f"{block.where} is not (any more) verbatim in {where}"


@pytest.mark.parametrize("block", [b for b in _python_blocks() if "tested-by" in b.attrs],
                         ids=lambda b: b.where)
def test_tested_by_names_a_test_that_reads_this_doc(block):
    test = (ROOT / block.attrs["tested-by"]).read_text()
    assert block.path.name in test, f"{block.where}: {block.attrs['tested-by']} does not read this doc"


@pytest.mark.parametrize("chain", chains(), ids=lambda c: "+".join(b.where for b in c))
def test_python_block_runs(chain, tmp_path):
    attrs = {}
    for b in chain:                    # a chain's words may sit on any of its blocks
        for key, value in b.attrs.items():
            assert attrs.setdefault(key, value) == value, f"{b.where}: {key}={value} but {attrs[key]} above"
    code = "".join(b.code for b in chain)
    ranks = int(attrs.get("ranks", 1))
    framework = attrs.get("framework", "torch")
    where = chain[0].where
    results = run_on(framework, ranks, doc_snippet.run, code, where, str(tmp_path), timeout=TIMEOUT_S)
    assert results == list(range(ranks))


# ---------------------------------------------------------------------------------------- commands
def commands():
    """(where, command) for every command of a bash block and every inline `command` in prose."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for b in blocks(path):
            if b.lang in ("bash", "sh", "shell"):
                for cmd in b.code.replace("\\\n", " ").split("\n"):
                    out += [(b.where, c.strip()) for c in cmd.split("#")[0].split("&&") if c.strip()]
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        for m in _INLINE.finditer(prose):
            if m.group(1).startswith(_COMMAND_START):
                line = text[:text.index(m.group(0))].count("\n") + 1
                out.append((f"{path.relative_to(ROOT)}:{line}", m.group(1)))
    return out


def _saved_scripts(where):
    """Scripts a python block of this doc says to save: ``x.py`` in its first-line comment."""
    path = ROOT / where.rsplit(":", 1)[0]
    return {name for b in blocks(path) if b.lang == "python"
            for name in re.findall(r"\b([\w-]+\.py)\b", b.code.split("\n")[0])}


@functools.lru_cache(maxsize=None)
def _help(target, subcommand=None):
    """``target``'s --help (its ``subcommand``'s, for a command line with subcommands)."""
    cmd = [sys.executable, *(["-m", target] if not target.endswith(".py") else [target]),
           *([subcommand] if subcommand else []), "--help"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HP_PLATFORM")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr}"
    return done.stdout


def _extras():
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _target(where, words):
    """What a python / torchrun / msrun command runs: (module or script, whether it is ours to --help)."""
    if "-m" in words:
        target = words[words.index("-m") + 1]
        path = ROOT / target.replace(".", "/")
        assert target == "pytest" or path.with_suffix(".py").exists() or (path / "__main__.py").exists(), \
            f"{where}: no module {target} in this checkout"
        return target, target != "pytest"
    scripts = [w for w in words[1:] if w.endswith(".py")]
    assert scripts, f"{where}: cannot tell what {' '.join(words)!r} runs"
    if (ROOT / scripts[0]).exists():
        return scripts[0], True
    assert scripts[0] in _saved_scripts(where), f"{where}: {scripts[0]} is neither a file nor a block here"
    return scripts[0], False


def _check_command(where, command):
    words = [w for w in shlex.split(command) if not re.match(r"^[A-Z_]+=", w)]
    tool = pathlib.Path(words[0]).name if words else ""
    if tool not in ("pip", "bash", "msrun", "torchrun") and not tool.startswith("python"):
        return                                     # source, export, a bare variable: nothing to check
    if "-c" in words:
        compile(words[words.index("-c") + 1], where, "exec")
    elif tool == "pip":
        for extras in re.findall(r"\.\[([\w,-]+)\]", command):
            missing = set(extras.split(",")) - _extras()
            assert not missing, f"{where}: pip extras {missing} are not in pyproject.toml ({_extras()})"
    elif tool == "bash":
        assert (ROOT / words[1]).exists(), f"{where}: {words[1]} does not exist"
    else:
        assert tool != "msrun" or "--join True" in command, \
            f"{where}: msrun without --join True returns before the workers end"
        target, ours = _target(where, words)
        rest = words[words.index(target) + 1:]
        # python -m hyper_parallel.plan search --model ...: the options are the subcommand's
        subcommand = rest[0] if rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]) else None
        flags = [w.split("=")[0] for w in rest if w.startswith("--")]
        unknown = [f for f in flags if f not in _help(target, subcommand)] if ours else []
        assert not unknown, f"{where}: {target} has no option {unknown} (see its --help)"


@pytest.mark.parametrize("where,command", commands(), ids=[f"{w} {c[:40]}" for w, c in commands()])
def test_command_is_valid(where, command):
    _check_command(where, command)
