"""Token shards: raw little-endian arrays plus a JSON manifest that says everything about them.

Nothing is guessed from file sizes: the manifest records the dtype, vocab size, tokenizer, token
and document counts and a SHA-256 per shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

from forge.data.corpus import Document
from forge.errors import UserInputError
from forge.data.tokenizer import ByteTokenizer

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class DataError(UserInputError):
    """A dataset on disk is missing, malformed or does not match the config."""


@attrs.frozen
class ShardInfo:
    file: str
    num_tokens: int
    sha256: str


@attrs.frozen
class SplitInfo:
    shards: tuple[ShardInfo, ...]
    num_tokens: int
    num_documents: int


@attrs.frozen
class Manifest:
    """The parsed ``manifest.json`` of a prepared dataset folder."""

    dtype: str
    vocab_size: int
    tokenizer: dict[str, Any]
    splits: dict[str, SplitInfo]
    source: str


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def sha256_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_dataset(
    out: pathlib.Path,
    splits: dict[str, Iterable[Document]],
    tokenizer: ByteTokenizer,
    source: str,
    shard_tokens: int = 1 << 24,
) -> Manifest:
    """Tokenize documents into shards under ``out``: written in a temporary folder, then renamed.

    Each document is framed as BOS + bytes + EOS. A crash leaves no half-written dataset.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    split_infos: dict[str, SplitInfo] = {}
    for split, docs in splits.items():
        shards: list[ShardInfo] = []
        buffer: list[np.ndarray] = []
        buffered = 0
        n_docs = 0

        def flush(split: str = split) -> None:
            nonlocal buffer, buffered
            if not buffered:
                return
            name = f"{split}_{len(shards):05d}.bin"
            np.concatenate(buffer).astype(dtype).tofile(tmp / name)
            shards.append(ShardInfo(name, buffered, sha256_of(tmp / name)))
            buffer, buffered = [], 0

        for doc in docs:
            ids = np.frombuffer(doc.data, dtype=np.uint8).astype(dtype)
            framed = np.concatenate(
                [np.array([tokenizer.bos_id], dtype), ids, np.array([tokenizer.eos_id], dtype)]
            )
            buffer.append(framed)
            buffered += len(framed)
            n_docs += 1
            if buffered >= shard_tokens:
                flush()
        flush()
        split_infos[split] = SplitInfo(tuple(shards), sum(s.num_tokens for s in shards), n_docs)
    manifest = Manifest(
        dtype=dtype.name,
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer.describe(),
        splits=split_infos,
        source=source,
    )
    (tmp / MANIFEST).write_text(json.dumps(manifest_to_json(manifest), indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return manifest


def manifest_to_json(manifest: Manifest) -> dict[str, Any]:
    """The manifest as JSON values, with a format version."""
    return {"format_version": FORMAT_VERSION, **attrs.asdict(manifest)}


def read_manifest(folder: pathlib.Path) -> Manifest:
    """Parse ``folder/manifest.json``; a missing or malformed one is a ``DataError``."""
    path = folder / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{path}: no dataset manifest; run 'python scripts/prepare_data.py --out {folder}'"
        )
    try:
        raw = json.loads(path.read_text())
        splits = {
            name: SplitInfo(
                shards=tuple(ShardInfo(**s) for s in info["shards"]),
                num_tokens=int(info["num_tokens"]),
                num_documents=int(info["num_documents"]),
            )
            for name, info in raw["splits"].items()
        }
        return Manifest(
            dtype=str(raw["dtype"]),
            vocab_size=int(raw["vocab_size"]),
            tokenizer=dict(raw["tokenizer"]),
            splits=splits,
            source=str(raw["source"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(
            f"{path}: malformed manifest ({exc!r}); re-run scripts/prepare_data.py"
        ) from None


def open_split(
    folder: pathlib.Path, manifest: Manifest, split: str, verify: bool
) -> list[np.ndarray]:
    """Memory-map each shard of ``split``, checking size and (optionally) checksum."""
    if split not in manifest.splits:
        raise DataError(
            f"{folder / MANIFEST}: no split '{split}' (has {sorted(manifest.splits)}); "
            "set data.train_split / data.eval_split"
        )
    arrays = []
    for shard in manifest.splits[split].shards:
        path = folder / shard.file
        if not path.is_file():
            raise DataError(f"{path}: shard listed in the manifest is missing; re-prepare the data")
        arr = np.memmap(path, dtype=np.dtype(manifest.dtype), mode="r")
        if len(arr) != shard.num_tokens:
            raise DataError(
                f"{path}: holds {len(arr)} tokens, manifest says {shard.num_tokens}; "
                "re-prepare the data"
            )
        if verify and sha256_of(path) != shard.sha256:
            raise DataError(f"{path}: checksum mismatch with the manifest; re-prepare the data")
        arrays.append(arr)
    return arrays
