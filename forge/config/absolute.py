"""A config's local paths made absolute against the folder its launch ran in: what a run
records (``config.toml``), so that a reader of the run (``eval.py``, ``generate.py``,
``convert_checkpoint.py export``, the follower) started from another folder finds the run's
data, checkpoints and task folders instead of looking beside itself. A path that is absolute
already, and an object-store URL, stay as they are."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Mapping

import attrs
import tomli

from forge.config.loader import ConfigError, structure_config, unstructure_config
from forge.config.ranges import url_scheme
from forge.config.sections import JobConfig
from forge.config.toml_writer import dumps_toml


def launch_folder(environ: Mapping[str, str]) -> pathlib.Path:
    """The folder this launch runs in, as the user's shell names it: ``$PWD`` where it is this
    folder (a symlinked or automounted home stays as typed, as other nodes see it), else the
    physical one."""
    pwd = environ.get("PWD", "")
    if os.path.isabs(pwd):
        with contextlib.suppress(OSError):
            if os.path.samefile(pwd, "."):
                return pathlib.Path(pwd)
    return pathlib.Path.cwd()


def absolute(path: str | None, cwd: pathlib.Path) -> str | None:
    """``path`` joined to ``cwd`` when it is a relative local path; else itself."""
    if not path or url_scheme(path) is not None or pathlib.Path(path).is_absolute():
        return path
    return str(pathlib.Path(cwd, path))


def with_absolute_paths(config: JobConfig, cwd: pathlib.Path) -> JobConfig:
    """``config`` with every local path key absolute against ``cwd``: ``run.dir``,
    ``data.path`` and each source's, ``checkpoint.dir`` and ``load_path``, each
    ``[[eval.tasks]]``' ``include_path``, ``model.vision.path``."""
    data, ckpt, model = config.data, config.checkpoint, config.model
    vision = model.vision
    if vision is not None and vision.path:
        model = attrs.evolve(model, vision=attrs.evolve(vision, path=absolute(vision.path, cwd)))
    sources = tuple(attrs.evolve(s, path=absolute(s.path, cwd)) for s in data.sources)
    tasks = tuple(
        attrs.evolve(t, include_path=absolute(t.include_path, cwd)) for t in config.eval.tasks
    )
    return attrs.evolve(
        config,
        run=attrs.evolve(config.run, dir=absolute(config.run.dir, cwd)),
        model=model,
        data=attrs.evolve(data, path=absolute(data.path, cwd), sources=sources),
        eval=attrs.evolve(config.eval, tasks=tasks),
        checkpoint=attrs.evolve(
            ckpt, dir=absolute(ckpt.dir, cwd), load_path=absolute(ckpt.load_path, cwd)
        ),
    )


def recorded_text(text: str, cwd: pathlib.Path) -> str:
    """A recorded config's text as a launch from ``cwd`` records it: a run recorded with
    relative paths (by a forge before they were recorded absolute), relaunched from the
    folder it ran in, reads as the config in force and writes no ``config.step_N.toml``.
    ``text`` itself when it is no config (a record a newer or damaged forge wrote)."""
    try:
        config = structure_config(tomli.loads(text))
    except (tomli.TOMLDecodeError, ConfigError):
        return text
    return dumps_toml(unstructure_config(with_absolute_paths(config, cwd)))
