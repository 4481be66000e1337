"""What a run records of its local paths (``forge.config.absolute``): absolute against the
launch's folder; absolute paths and object-store URLs as they are."""

from __future__ import annotations

import pathlib

import pytest

from forge.config import load_config
from forge.config.absolute import absolute, with_absolute_paths

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
