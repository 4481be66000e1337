"""generate.py and convert_checkpoint.py at 2 real ranks (tests/ranks.py, gloo, CPU): the same
device path a GPU job takes, with the results a single process gives."""

from __future__ import annotations

import json
import pathlib
import subprocess

from tests.conftest import REPO
from tests.e2e.test_train_script import load_script
from tests.ranks import run_ranks

GENERATE, CONVERT = load_script("generate"), load_script("convert_checkpoint")


def launched(script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` at 2 ranks."""
    return run_ranks(2, [str(REPO / "scripts" / script), *args])


def in_process(main, args: list[str], capsys) -> str:
    """``main(args)`` run here, as one process; its standard output."""
    capsys.readouterr()
    assert main(args) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_each_rank_samples_its_own_seed_and_rank_0_prints_both(trained, capsys):
    args = [str(trained.dir), "--max-new-tokens", "12", "--temperature", "1.0", "--seed", "4"]
    two = launched("generate.py", *args)
    assert two.returncode == 0, two.stderr[-2000:]
    seed4 = in_process(GENERATE.main, args, capsys)
    seed5 = in_process(GENERATE.main, [*args[:-1], "5"], capsys)
    lines = two.stdout.splitlines()
    assert lines[0] == "# rank 0 (seed 4)"
    at = lines.index("# rank 1 (seed 5)")
    assert "\n".join(lines[1:at]) == seed4.rstrip("\n")
    assert "\n".join(lines[at + 1 :]) == seed5.rstrip("\n")
    assert seed4 != seed5


def test_an_export_at_two_ranks_writes_the_same_files_once(trained, tmp_path, capsys):
    export = ["export", str(trained.dir), "--dtype", "float32", "--out"]
    in_process(CONVERT.main, [*export, str(tmp_path / "one")], capsys)
    two = launched("convert_checkpoint.py", *export, str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("exported") == 1  # rank 0 writes and says so
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    assert config["torch_dtype"] == "float32"


def test_a_refused_export_at_two_ranks_is_one_line_and_exit_2(trained, tmp_path: pathlib.Path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    done = launched("convert_checkpoint.py", "export", str(trained.dir), "--out",
                    str(tmp_path / "taken"))  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]  # the rank's own code (no agent's 1)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "--out" in errors[0], done.stderr[-2000:]
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
