"""The embedded default corpus: the running interpreter's standard-library source files."""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig
from collections.abc import Iterator

import attrs


@attrs.frozen
class Document:
    """One source document: a stable name and its raw bytes."""

    name: str
    data: bytes


def stdlib_root() -> pathlib.Path:
    """Folder of the running interpreter's standard library."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: pathlib.Path) -> list[pathlib.Path]:
    """Every ``*.py`` under ``root`` except installed packages, sorted by relative path."""
    files = [
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def iter_documents(root: pathlib.Path, files: list[pathlib.Path]) -> Iterator[Document]:
    """Documents in the given order, named by their path relative to ``root``."""
    for path in files:
        yield Document(name=path.relative_to(root).as_posix(), data=path.read_bytes())


def split_of(name: str, validation_percent: float) -> str:
    """``"validation"`` for a stable hash-chosen share of document names, else ``"train"``."""
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % 10_000
    return "validation" if bucket < validation_percent * 100 else "train"
