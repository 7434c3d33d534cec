"""Every example in README.md runs, offline.

The README's code blocks are fenced and tagged:

- ```bash: one `distplan ...` command per line (comments and blank lines allowed), each run through click's
  CliRunner on `distplan.planner.cli:main`, exit code 0;
- ```console: `$ distplan ...` lines, each followed by the output shown for it. The command is run as above,
  and every shown output line must be a line of what it prints now (whitespace-normalized; a line `...`
  stands for lines left out). The output was taken on the pinned torch (2.13), which a plan follows, so the
  output is compared on that release only; the command runs on every release;
- ```python: exec'd in a fresh namespace;
- ```sh (set-up, pytest: run by CI itself) and ```text (the JSON contract, the file layout): not run.

A second word in the tag, `slow` (```console slow), marks a block of more than a few seconds (it launches
probes or imports torch and transformers): it runs in the slow tier. Blocks run in a temporary directory
that links the repository's examples/, tests/ and benchmarks/, so that files the examples write (results,
charts, calibration overlays) land there; no example reaches the Hugging Face Hub.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from distplan.planner.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUN = {"bash", "console", "python"}
SKIP = {"sh", "text"}
ELLIPSIS = "..."


def readme_blocks(text: str | None = None) -> list[dict]:
    """The fenced blocks of the README: {"line", "lang", "slow", "body"}."""
    lines = (README.read_text(encoding="utf-8") if text is None else text).split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        words = m.group(1).split()
        start, body, i = i + 1, [], i + 1
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"README.md:{start}: unclosed code fence"
        blocks.append({"line": start, "lang": words[0] if words else "", "slow": "slow" in words[1:],
                       "body": body})
        i += 1
    return blocks


BLOCKS = readme_blocks()
RUNNABLE = [b for b in BLOCKS if b["lang"] in RUN]


def _param(b):
    return pytest.param(b, id=f"{b['lang']}-line{b['line']}", marks=[pytest.mark.slow] if b["slow"] else [])


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A temporary directory with the repository's example files, and an environment that cannot change
    the output shown (table width, catalog overlay, NCCL and allocator settings, a GPU)."""
    for name in ("examples", "tests", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    for key in ("COLUMNS", "DISTPLAN_CATALOG", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def run_distplan(command: str) -> str:
    argv = shlex.split(command)
    assert argv[0] == "distplan", f"not a distplan command: {command!r}"
    r = CliRunner().invoke(main, argv[1:], catch_exceptions=False)
    assert r.exit_code == 0, f"{command}\nexit {r.exit_code}\n{r.output[-3000:]}"
    return r.output


def _norm(line: str) -> str:
    return " ".join(line.split())


def _output_compared() -> bool:
    from distplan.planner import config
    return config.torch_release() == (2, 13)


def check_output(command: str, shown: list[str], got: str) -> None:
    """Every shown line is a line of `got`, in order; `...` skips any number of lines."""
    if not _output_compared():
        return
    got_lines = [_norm(x) for x in got.split("\n")]
    pos = 0
    for line in shown:
        want = _norm(line)
        if want == ELLIPSIS or not want:
            continue
        for j in range(pos, len(got_lines)):
            if got_lines[j] == want:
                pos = j + 1
                break
        else:
            raise AssertionError(f"README output of `{command}` is stale: {line!r} is not printed "
                                 f"(after line {pos}); it prints:\n{got}")


def console_commands(body: list[str]) -> list[tuple[str, list[str]]]:
    cmds: list[tuple[str, list[str]]] = []
    for line in body:
        if line.startswith("$ "):
            cmds.append((line[2:], []))
        else:
            assert cmds, f"console block output before any `$ ` command: {line!r}"
            cmds[-1][1].append(line)
    return cmds


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_readme_block_runs(block, workdir):
    body = block["body"]
    if block["lang"] == "python":
        code = "\n".join(body)
        assert code.strip()
        exec(compile(code, f"README.md:{block['line']}", "exec"), {"__name__": "__readme__"})
        return
    if block["lang"] == "console":
        cmds = console_commands(body)
    else:  # bash
        cmds = [(line, []) for line in body if line.strip() and not line.lstrip().startswith("#")]
    assert cmds, f"README.md:{block['line']}: no command in the block"
    for command, shown in cmds:
        got = run_distplan(command)
        check_output(command, shown, got)


def test_every_readme_block_is_run_or_exempt():
    """Each fenced block is either run above (bash, console, python) or a set-up/test command or a listing
    (sh, text); an untagged or otherwise tagged block, or a 4-space indented code block, is an error."""
    assert BLOCKS, "no code blocks found in README.md"
    for b in BLOCKS:
        assert b["lang"] in RUN | SKIP, f"README.md:{b['line']}: code block tagged {b['lang']!r}: use one of " \
                                        f"{sorted(RUN | SKIP)}"
    assert len(RUNNABLE) == len(BLOCKS) - sum(b["lang"] in SKIP for b in BLOCKS)
    # the ones CI does not run are the set-up, the test command and listings, nothing with `distplan` in a
    # command position but the set-up line of "Set up and run"
    for b in BLOCKS:
        if b["lang"] == "sh":
            assert all(line.startswith(("python3 -m venv", ".venv/bin/python -m pytest")) for line in b["body"]), b
    # no indented code blocks outside fences (they would not be run)
    inside, prev_blank = False, True
    for n, line in enumerate(README.read_text(encoding="utf-8").split("\n"), 1):
        if line.startswith("```"):
            inside = not inside
        elif not inside and prev_blank and line.startswith("    ") and line.strip():
            raise AssertionError(f"README.md:{n}: indented code block; fence it with a language tag")
        prev_blank = not line.strip()


def test_readme_commands_are_the_documented_ones():
    """The set-up and test commands CI and users copy are the README's, verbatim."""
    text = README.read_text(encoding="utf-8")
    assert ("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/distplan estimate --params 7B "
            "--gpus 8 --gpu-mem 80") in text
    assert ("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e '.[test]' "
            "&& .venv/bin/python -m pytest -q -n auto --dist loadfile") in text
    assert '.venv/bin/python -m pytest -n auto -m "not slow"' in text
    for doc in ("docs/validation.md", "docs/allocator.md", "docs/speed.md", "docs/reference.md"):
        assert f"({doc}" in text and (ROOT / doc).is_file(), doc


def test_the_parser_sees_every_kind():
    text = "a\n```bash\ndistplan catalog list\n```\n```console slow\n$ distplan x\nout\n```\n```sh\nls\n```\n"
    got = readme_blocks(text)
    assert [(b["lang"], b["slow"], b["body"]) for b in got] == [
        ("bash", False, ["distplan catalog list"]), ("console", True, ["$ distplan x", "out"]), ("sh", False, ["ls"])]
    assert console_commands(["$ distplan a", "x", "...", "$ distplan b"]) == [
        ("distplan a", ["x", "..."]), ("distplan b", [])]
