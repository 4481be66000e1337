"""Tokenizers: the built-in byte level one (ids 0-255 are bytes, then BOS, EOS and PAD), or a
Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from forge.errors import UserInputError


@attrs.frozen
class ByteTokenizer:
    """Lossless on any text: UTF-8 bytes plus three special ids."""

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def name(self) -> str:
        return "byte"

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally framed by BOS / EOS."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        ids = list(data)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def frame(self, data: bytes, dtype: np.dtype) -> np.ndarray:
        """BOS + bytes + EOS as an id array (the ids are the bytes: no Python lists)."""
        ids = np.empty(len(data) + 2, dtype=dtype)
        ids[0], ids[-1] = self.bos_id, self.eos_id
        ids[1:-1] = np.frombuffer(data, dtype=np.uint8)
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special ids are dropped and broken UTF-8 is replaced."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        """What the manifest records about this tokenizer."""
        return {
            "type": self.name,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
        }


@attrs.frozen
class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (needs the optional ``tokenizers`` package).

    Documents are framed with the tokenizer's own BOS / EOS tokens, named by ``bos_token`` /
    ``eos_token``; the encoding adds no other special tokens.
    """

    path: str
    bos_token: str
    eos_token: str
    _tok: Any = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        tok = read_tokenizer_json(self.path)
        for flag, token in (("--bos-token", self.bos_token), ("--eos-token", self.eos_token)):
            if tok.token_to_id(token) is None:
                raise TokenizerError(
                    f"{flag} {token!r}: not in the vocabulary of {self.path}; name the "
                    "tokenizer's own begin/end-of-text tokens"
                )
        object.__setattr__(self, "_tok", tok)

    @property
    def bos_id(self) -> int:
        return int(self._tok.token_to_id(self.bos_token))

    @property
    def eos_id(self) -> int:
        return int(self._tok.token_to_id(self.eos_token))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def name(self) -> str:
        return "hf"

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally framed by BOS / EOS."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def frame(self, data: bytes, dtype: np.dtype) -> np.ndarray:
        """BOS + the UTF-8 text's ids + EOS as an id array."""
        return np.asarray(self.encode(data, bos=True, eos=True), dtype=dtype)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return self._tok.decode(ids, skip_special_tokens=True)

    def describe(self) -> dict[str, Any]:
        """What the manifest records about this tokenizer (the file by path and hash)."""
        return {
            "type": self.name,
            "path": self.path,
            "sha256": hashlib.sha256(pathlib.Path(self.path).read_bytes()).hexdigest(),
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }


class TokenizerError(UserInputError):
    """A tokenizer cannot be loaded or lacks what framing documents needs."""


def read_tokenizer_json(path: str) -> Any:
    """A ``tokenizers.Tokenizer`` from ``path``; a missing package or bad file is a
    ``TokenizerError``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError(
            f"--tokenizer {path}: needs the 'tokenizers' package; pip install -e '.[hf]'"
        ) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises plain Exception
        raise TokenizerError(f"--tokenizer {path}: cannot be read ({exc})") from None


def first_known_token(path: str, candidates: Sequence[str], flag: str) -> str:
    """The first of ``candidates`` in the vocabulary of ``path`` (a default for ``flag``)."""
    vocab = read_tokenizer_json(path).get_vocab(with_added_tokens=True)
    for token in candidates:
        if token in vocab:
            return token
    raise TokenizerError(f"--tokenizer {path}: name its document-boundary token with {flag}")


Tokenizer = ByteTokenizer | HFTokenizer


def tokenizer_from_manifest(description: dict[str, Any]) -> Tokenizer:
    """The tokenizer a dataset manifest describes."""
    if description.get("type") == "hf":
        return HFTokenizer(
            str(description["path"]), str(description["bos_token"]), str(description["eos_token"])
        )
    return ByteTokenizer()
