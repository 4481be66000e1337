"""Tokenizer files for a Hugging Face export: a ``tokenizer.json`` that encodes exactly as
forge's byte tokenizer does, and the ``tokenizer_config.json`` ``AutoTokenizer`` reads."""

from __future__ import annotations

from typing import Any

BYTE_SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")  # ids 256, 257, 258, as ByteTokenizer's


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what a byte-level ``tokenizers`` model uses
    as the token of that byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> str:
    """A ``tokenizers`` byte-level tokenizer whose ids are forge's: byte ``b`` is id ``b``,
    then ``<bos>``, ``<eos>``, ``<pad>`` (needs the optional ``tokenizers`` package)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in BYTE_SPECIAL_TOKENS])
    return tok.to_str()


def tokenizer_config(
    bos: str | None, eos: str | None, pad: str | None, max_len: int
) -> dict[str, Any]:
    """``tokenizer_config.json`` for a fast tokenizer with these special tokens."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
    }
    for key, token in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)):
        if token is not None:
            config[key] = token
    return config
