"""Every script that reads a checkpoint takes the same forms of path: a run directory (the
checkpoint training would resume from) or one ``step_N`` folder of it, which it then reads."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_script import load_script
from tests.in_process import run_main

SCRIPTS = REPO / "scripts"

# (script and its arguments before the path, after it); {out} is a fresh folder
READERS = {
    "eval.py": (["eval.py"], []),
    "generate.py": (["generate.py"], ["--max-new-tokens", "4", "--prompt", "def "]),
    "convert_checkpoint.py export": (["convert_checkpoint.py", "export"], ["--out", "{out}"]),
}


def run_script(words: list[str], path, tail: list[str], out) -> subprocess.CompletedProcess:
    """The script on ``path``, in this process (which path it reads is all that is asked)."""
    args = [*words[1:], str(path), *(w.replace("{out}", str(out)) for w in tail)]
    return run_main(load_script(words[0].removesuffix(".py")).main, args)


@pytest.mark.parametrize("script", READERS)
@pytest.mark.parametrize("form", ["run directory", "step folder"])
def test_every_checkpoint_reader_takes_a_run_directory_or_a_step_folder(
    trained, tmp_path, script, form
):
    words, tail = READERS[script]
    path = trained.dir if form == "run directory" else trained.ckpt / "step_5"
    if "export" in words:
        pytest.importorskip("safetensors")
    out = run_script(words, path, tail, tmp_path / "out")
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("step_10" if form == "run directory" else "step_5") in out.stdout + out.stderr


@pytest.mark.parametrize("script", READERS)
def test_a_path_that_is_neither_is_one_line_and_exit_2(trained, tmp_path, script):
    words, tail = READERS[script]
    out = run_script(words, trained.data, tail, tmp_path / "out")
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "neither a run directory" in errors[0], out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out").exists()
