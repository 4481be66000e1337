"""forge's cache folder: what a process measured or indexed once and later ones read (a CPU's
matmul peak, lm-eval's task names). A cache never stops a run: one that is missing, corrupt
or unwritable costs only the work it would have saved."""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
from collections.abc import Mapping


def cache_dir(environ: Mapping[str, str], home: pathlib.Path | None) -> pathlib.Path | None:
    """forge's cache folder: ``$FORGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/forge``, else
    ``~/.cache/forge``; None without any of them (no home directory)."""
    if environ.get("FORGE_CACHE_DIR"):
        return pathlib.Path(environ["FORGE_CACHE_DIR"])
    if environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(environ["XDG_CACHE_HOME"]) / "forge"
    return None if home is None else home / ".cache" / "forge"


def this_cache_dir() -> pathlib.Path | None:
    """``cache_dir`` of this process's environment and home folder."""
    try:
        home: pathlib.Path | None = pathlib.Path.home()
    except (RuntimeError, KeyError):  # no HOME and no passwd entry
        home = None
    return cache_dir(os.environ, home)


def write_cache_file(path: pathlib.Path, text: str) -> str | None:
    """``text`` written whole to a temporary sibling of ``path`` and renamed into place (a
    reader never sees half a file). None when written, else why not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # gone after a rename
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None
