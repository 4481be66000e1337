"""What a run records of its local paths (``forge.config.absolute``): absolute against the
launch's folder; absolute paths and object-store URLs as they are."""

from __future__ import annotations

import pathlib

import pytest

from forge.config import load_config
from forge.config.absolute import absolute, launch_folder, recorded_text, with_absolute_paths
from forge.config.loader import unstructure_config
from forge.config.toml_writer import dumps_toml
from forge.training.records.run_records import recorded_configs, write_run_records

CWD = pathlib.Path("/launch/here")

# (path, what is recorded)
PATHS = [
    ("data/stdlib", "/launch/here/data/stdlib"),
    ("./runs/a", "/launch/here/runs/a"),
    ("../shared/data", "/launch/here/../shared/data"),
    ("/abs/data", "/abs/data"),
    ("s3://bucket/prefix", "s3://bucket/prefix"),
    ("gs://bucket/x", "gs://bucket/x"),
    (None, None),
]


@pytest.mark.parametrize("path,recorded", PATHS)
def test_a_relative_local_path_is_recorded_against_the_launch_folder(path, recorded):
    assert absolute(path, CWD) == recorded


def test_every_local_path_key_of_a_config_is_recorded_absolute(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(
        '[run]\ndir = "runs/a"\n[checkpoint]\ndir = "ckpt"\nload_path = "s3://b/step_4"\n'
        '[data]\n[[data.sources]]\nname = "web"\npath = "web"\nweight = 1.0\n'
        '[[eval.tasks]]\nname = "t"\ninclude_path = "tasks"\n'
        '[model]\nvlm = "joint_decoder"\n[model.vision]\nencoder = "hf"\npath = "enc"\n'
    )
    cfg = with_absolute_paths(load_config([str(config)]).config, CWD)
    assert cfg.run.dir == "/launch/here/runs/a"
    assert cfg.checkpoint.dir == "/launch/here/ckpt"
    assert cfg.checkpoint.load_path == "s3://b/step_4"
    assert [s.path for s in cfg.data.sources] == ["/launch/here/web"]
    assert [t.include_path for t in cfg.eval.tasks] == ["/launch/here/tasks"]
    assert cfg.model.vision is not None and cfg.model.vision.path == "/launch/here/enc"


def test_a_run_recorded_with_relative_paths_resumed_from_its_folder_records_no_change(tmp_path):
    """A run recorded before local paths were recorded absolute: the same command in the
    same folder is the config in force (``recorded_text``), not a change at its step."""
    config = tmp_path / "c.toml"
    config.write_text('[run]\ndir = "runs/a"\n[data]\npath = "data/stdlib"\n')
    cfg = load_config([str(config)]).config
    relative = dumps_toml(unstructure_config(cfg))
    absolute_text = dumps_toml(unstructure_config(with_absolute_paths(cfg, CWD)))
    assert relative != absolute_text
    assert recorded_text(relative, CWD) == recorded_text(absolute_text, CWD) == absolute_text
    assert recorded_text("not [ toml", CWD) == "not [ toml"  # no config: compared as it is
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(relative)
    problem = write_run_records(
        run, run / "metrics.jsonl", 10, absolute_text, None, lambda t: recorded_text(t, CWD)
    )
    assert problem is None and sorted(recorded_configs(run)) == [0]
    assert (run / "config.toml").read_text() == relative  # never rewritten


@pytest.mark.parametrize(
    "pwd,named",
    [("link", "link"), ("real", "real"), ("other", "real"), ("relative", "real"), (None, "real")],
)
def test_the_launch_folder_is_the_shells_name_for_it_where_that_is_this_folder(
    tmp_path, monkeypatch, pwd, named
):
    """A symlinked (or automounted) folder is recorded as typed: other nodes see that path."""
    (tmp_path / "real").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path / "real")
    environ = {} if pwd is None else {"PWD": "link" if pwd == "relative" else str(tmp_path / pwd)}
    assert launch_folder(environ) == (tmp_path / named).absolute()
