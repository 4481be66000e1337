"""The README and docs/ hold true: every Python snippet runs, and every command names a script
that exists, runs under the virtual environment, and passes options the script accepts (train
overrides are validated against the config schema). What each command *does* is covered by the
end-to-end tests of its script."""

from __future__ import annotations

import functools
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from forge.config import load_config
from tests.conftest import REPO
from tests.e2e.test_train_script import load_script
from tests.in_process import run_main

PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SCRIPT = re.compile(r"(?:scripts|benchmarks)/[\w/]+\.py")


def blocks(kind: str) -> list[tuple[str, str]]:
    """``(page:line, text)`` of every fenced block of ``kind``."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == kind:
                line = text[: m.start()].count("\n") + 1
                found.append((f"{page.name}:{line}", m.group(2)))
    return found


def commands() -> list[tuple[str, list[str], bool]]:
    """Each shell command of the docs' bash blocks, as words (comments and prompts dropped),
    and whether the block activated the virtual environment before it."""
    found = []
    for where, text in blocks("bash"):
        active = False
        for raw in text.replace("\\\n", " ").splitlines():
            line = raw.split(" #")[0].strip().removeprefix("$ ")
            if not line or line.startswith("#"):
                continue
            words = shlex.split(line)
            found.append((where, words, active))
            active = active or words[:2] == ["source", ".venv/bin/activate"]
    return found


PYTHON_BLOCKS = blocks("python")
COMMANDS = commands()


def test_the_docs_have_snippets_and_commands():
    assert len(PYTHON_BLOCKS) >= 2 and len(COMMANDS) >= 20


@pytest.mark.parametrize("where,code", PYTHON_BLOCKS, ids=[w for w, _ in PYTHON_BLOCKS])
def test_python_snippets_run(where, code):
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, f"{where}:\n{out.stderr}"


@pytest.mark.parametrize("where,words,active", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_commands_use_the_venv_and_name_real_scripts(where, words, active):
    program = words[0]
    assert active or program not in ("python", "python3", "torchrun", "pip"), (
        f"{where}: '{program}' is not the venv's; write .venv/bin/{program}"
    )
    for word in words:
        for script in SCRIPT.findall(word):
            assert (REPO / script).is_file(), f"{where}: {script} does not exist"


@functools.cache
def script_help(script: str, subcommand: str | None) -> str:
    # in this process: tests/e2e/test_script_help.py starts each script for its --help
    main = load_script(pathlib.PurePath(script).stem).main
    out = run_main(main, [*([subcommand] if subcommand else []), "--help"])
    assert out.returncode == 0, out.stderr
    return out.stdout


def script_invocations() -> list[tuple[str, str, list[str]]]:
    found = []
    for where, words, _ in COMMANDS:
        for i, word in enumerate(words):
            if word.startswith("scripts/") and word.endswith(".py"):
                found.append((where, word, words[i + 1 :]))
    return found


INVOCATIONS = script_invocations()


@pytest.mark.parametrize(
    "where,script,args", INVOCATIONS, ids=[f"{w} {s}" for w, s, _ in INVOCATIONS]
)
def test_script_options_in_the_docs_exist(where, script, args):
    if script == "scripts/train.py":
        if args == ["--help"]:
            return
        config, *overrides = args
        if (REPO / config).is_file():  # a config the repo ships: the whole line must validate
            load_config([str(REPO / config), *overrides])
        return
    if script == "scripts/plan.py":  # takes training's overrides beside its own options
        overrides = [a for a in args if a.startswith("--") and "." in a.split("=")[0]]
        load_config([str(REPO / args[0]), *overrides])
        args = [a for a in args if a not in overrides]
    subcommand = args[0] if script == "scripts/convert_checkpoint.py" else None
    known = set(re.findall(r"--[\w-]+", script_help(script, subcommand)))
    used = {a.split("=")[0] for a in args if a.startswith("--")}
    assert used <= known, f"{where}: {sorted(used - known)} not options of {script}"
