"""Byte-level tokenizer: ids 0-255 are bytes, then BOS, EOS and PAD."""

from __future__ import annotations

from typing import Any

import attrs


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
