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
from typing import Any, BinaryIO

import attrs
import numpy as np

from forge.data.corpus import Document
from forge.data.tokenizer import ByteTokenizer
from forge.errors import UserInputError
from forge.outputs import OutputKind, replace_output

MANIFEST = "manifest.json"
FORMAT_VERSION = 1  # what this forge writes
READABLE_VERSIONS = (1,)  # what this forge reads


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


TOKEN_DTYPES = ("uint16", "uint32")  # what ``token_dtype`` chooses: all a shard may hold


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def sha256_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def sha256_and_largest(path: pathlib.Path, dtype: np.dtype) -> tuple[str, int]:
    """The shard's SHA-256 and its largest token id, in one read."""
    h, largest = hashlib.sha256(), -1
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):  # whole tokens: 4 MiB per block
            h.update(block)
            largest = max(largest, int(np.frombuffer(block, dtype).max()))
    return h.hexdigest(), largest


class ShardWriter:
    """Appends token arrays to ``<split>_<k>.bin`` files in ``folder``, starting a new shard at
    the first array boundary past ``shard_tokens``; hashes each shard as it is written."""

    def __init__(
        self, folder: pathlib.Path, split: str, dtype: np.dtype, shard_tokens: int
    ) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.shards: list[ShardInfo] = []
        self.documents = 0
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._tokens = 0

    def append(self, tokens: np.ndarray, documents: int = 0) -> None:
        """Write ``tokens`` (whole documents) to the current shard."""
        if self._file is None:
            name = f"{self.split}_{len(self.shards):05d}.bin"
            self._file = (self.folder / name).open("wb")
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._file.write(data)
        self._hash.update(data)
        self._tokens += len(tokens)
        self.documents += documents
        if self._tokens >= self.shard_tokens:
            self._close_shard()

    def _close_shard(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = pathlib.Path(self._file.name).name
        self.shards.append(ShardInfo(name, self._tokens, self._hash.hexdigest()))
        self._file, self._hash, self._tokens = None, hashlib.sha256(), 0

    def close(self) -> SplitInfo:
        """Finish the last shard; the split's manifest entry."""
        self._close_shard()
        return SplitInfo(tuple(self.shards), sum(s.num_tokens for s in self.shards), self.documents)


def write_dataset(
    out: pathlib.Path,
    splits: dict[str, Iterable[Document]],
    tokenizer: ByteTokenizer,
    source: str,
    shard_tokens: int = 1 << 24,
) -> Manifest:
    """Tokenize documents into shards under ``out``, in one process: written in a temporary
    folder, then renamed. (``forge.data.prepare`` does the same in parallel, resumably.)

    Each document is framed as BOS + bytes + EOS. A crash leaves no half-written dataset.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    split_infos: dict[str, SplitInfo] = {}
    for split, docs in splits.items():
        writer = ShardWriter(tmp, split, dtype, shard_tokens)
        for doc in docs:
            writer.append(tokenizer.frame(doc.data, dtype), documents=1)
        split_infos[split] = writer.close()
    manifest = manifest_of(tokenizer, dtype, split_infos, source)
    publish(tmp, out, manifest)
    return manifest


def manifest_of(
    tokenizer: ByteTokenizer, dtype: np.dtype, splits: dict[str, SplitInfo], source: str
) -> Manifest:
    """The manifest of a dataset ``tokenizer`` wrote in ``dtype``: its splits and source."""
    return Manifest(
        dtype=dtype.name,
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer.describe(),
        splits=splits,
        source=source,
    )


def publish(
    tmp: pathlib.Path,
    out: pathlib.Path,
    manifest: Manifest,
    extra: dict[str, Any] | None = None,
    kind: OutputKind | None = None,
) -> None:
    """Write the manifest (plus ``extra`` keys) into ``tmp``, then rename ``tmp`` to ``out``
    (replacing it; with ``kind``, marked as that output, the earlier one removed only once the
    new one is in place: ``replace_output``)."""
    raw = {**manifest_to_json(manifest), **(extra or {})}
    (tmp / MANIFEST).write_text(json.dumps(raw, indent=2) + "\n")
    if kind is not None:
        replace_output(tmp, out, kind)
        return
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def manifest_to_json(manifest: Manifest) -> dict[str, Any]:
    """The manifest as JSON values, with a format version."""
    return {"format_version": FORMAT_VERSION, **attrs.asdict(manifest)}


def dataset_fingerprint(manifest: Manifest) -> str:
    """A short hash of what a dataset holds (tokenizer, every shard's checksum and length),
    not of where it lies: a moved copy is the same data."""
    content = {
        "dtype": manifest.dtype,
        "tokenizer": manifest.tokenizer,
        "splits": {
            name: [(s.sha256, s.num_tokens) for s in split.shards]
            for name, split in sorted(manifest.splits.items())
        },
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def read_manifest(folder: pathlib.Path) -> Manifest:
    """Parse ``folder/manifest.json``; a missing or malformed one, or one of a format version
    this forge does not read, is a ``DataError``."""
    path = folder / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{path}: no dataset manifest; run 'python scripts/prepare_data.py --out {folder}'"
        )
    try:
        raw = json.loads(path.read_text())
        version = raw["format_version"]
    except (KeyError, TypeError, ValueError) as exc:
        raise malformed(path, exc) from None
    check_format_version(path, version)
    try:
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
        raise malformed(path, exc) from None


def malformed(path: pathlib.Path, exc: Exception) -> DataError:
    """The one line for a manifest that cannot be parsed."""
    return DataError(f"{path}: malformed manifest ({exc!r}); re-run scripts/prepare_data.py")


def check_format_version(path: pathlib.Path, version: Any) -> None:
    """Refuse a manifest whose ``format_version`` this forge does not read (``DataError``):
    a newer forge's layout, read by these rules, would be misread silently."""
    if type(version) is int and version in READABLE_VERSIONS:  # not True, 1.0 or "1"
        return
    reads = f"this forge reads format_version {' or '.join(map(str, READABLE_VERSIONS))}"
    if type(version) is int and version > max(READABLE_VERSIONS):
        raise DataError(
            f"{path}: format_version {version} is a newer forge's ({reads}); upgrade forge, "
            "or re-prepare the data with this one's scripts/prepare_data.py"
        )
    raise DataError(
        f"{path}: format_version {version!r} is not one forge writes ({reads}); re-prepare "
        "the data with scripts/prepare_data.py"
    )


def open_split(
    folder: pathlib.Path, manifest: Manifest, split: str, verify: bool
) -> list[np.ndarray]:
    """Memory-map each shard of ``split``, checking size and (optionally) checksum."""
    if split not in manifest.splits:
        raise DataError(
            f"{folder / MANIFEST}: no split '{split}' (has {sorted(manifest.splits)}); "
            "set data.train_split / data.eval_split"
        )
    if manifest.dtype not in TOKEN_DTYPES:
        raise DataError(
            f"{folder / MANIFEST}: dtype '{manifest.dtype}' is not a token dtype forge writes "
            f"({', '.join(TOKEN_DTYPES)}); re-prepare the data"
        )
    dtype = np.dtype(manifest.dtype)
    arrays = []
    for shard in manifest.splits[split].shards:
        path = folder / shard.file
        if not path.is_file():
            raise DataError(f"{path}: shard listed in the manifest is missing; re-prepare the data")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise DataError(
                f"{path}: {size} bytes is not a whole number of {manifest.dtype} tokens "
                "(truncated or not a shard); re-prepare the data"
            )
        if size == 0:  # np.memmap refuses an empty file
            arrays.append(np.empty(0, dtype))
            if shard.num_tokens:
                raise DataError(
                    f"{path}: holds 0 tokens, manifest says {shard.num_tokens}; re-prepare the data"
                )
            continue
        arr = np.memmap(path, dtype=dtype, mode="r")
        if len(arr) != shard.num_tokens:
            raise DataError(
                f"{path}: holds {len(arr)} tokens, manifest says {shard.num_tokens}; "
                "re-prepare the data"
            )
        largest = None  # read with the checksum, in the same pass over the shard
        if verify:
            digest, largest = sha256_and_largest(path, dtype)
            if digest != shard.sha256:
                raise DataError(f"{path}: checksum mismatch with the manifest; re-prepare the data")
        if largest is None or largest >= manifest.vocab_size:
            check_token_ids(path, arr, manifest.vocab_size)
        arrays.append(arr)
    return arrays


ID_CHECK_CHUNK = 1 << 24  # tokens per pass: bounded memory for the comparison


def check_token_ids(path: pathlib.Path, tokens: np.ndarray, vocab_size: int) -> None:
    """Refuse a shard holding an id outside the manifest's vocabulary, once at start-up (a
    per-batch check would cost every step; an embedding lookup would fail with a traceback)."""
    for start in range(0, len(tokens), ID_CHECK_CHUNK):
        chunk = tokens[start : start + ID_CHECK_CHUNK]
        if int(chunk.max()) < vocab_size:
            continue
        at = start + int(np.argmax(chunk >= vocab_size))
        raise DataError(
            f"{path}: token {at} is id {int(tokens[at])}, outside the manifest's vocab_size "
            f"{vocab_size}; the shard was not written by this dataset's tokenizer: re-prepare "
            "the data"
        )
