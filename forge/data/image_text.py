"""Image–caption datasets: a token dataset of the captions (forge's usual shards and
manifest, one caption per document, so a text-only model can train on the same captions) plus,
per split, one file of ``uint8`` images ``(N, size, size, 3)`` and one of caption offsets,
listed in the manifest under ``images`` with their checksums.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from forge.data.packing import IGNORE_INDEX
from forge.data.shards import (
    MANIFEST,
    DataError,
    Manifest,
    ShardWriter,
    SplitInfo,
    manifest_of,
    open_split,
    publish,
    read_manifest,
    sha256_of,
    token_dtype,
)
from forge.data.tokenizer import ByteTokenizer
from forge.errors import UserInputError
from forge.outputs import OutputKind, staged_output

IMAGES_KEY = "images"


@attrs.frozen
class ImageSplit:
    """One split's images ``(N, size, size, 3)`` (memory-mapped) and the token offset of
    each example's caption in the split's token stream ``(N + 1,)``."""

    images: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.images)


def write_image_text_dataset(
    out: pathlib.Path,
    splits: dict[str, Iterable[tuple[np.ndarray, str]]],
    tokenizer: ByteTokenizer,
    image_size: int,
    source: str,
) -> Manifest:
    """Write ``(image, caption)`` pairs under ``out`` (via a temporary folder, renamed at the
    end: a crash leaves nothing half-written). Each caption is framed BOS + bytes + EOS."""
    with staged_output(out) as tmp:
        dtype = token_dtype(tokenizer.vocab_size)
        infos: dict[str, SplitInfo] = {}
        images: dict[str, dict[str, object]] = {}
        for split, pairs in splits.items():
            writer = ShardWriter(tmp, split, dtype, 1 << 24)
            offsets = [0]
            image_file = tmp / f"{split}_images.bin"
            with image_file.open("wb") as f:
                for image, text in pairs:
                    if image.shape != (image_size, image_size, 3) or image.dtype != np.uint8:
                        raise DataError(
                            f"image {len(offsets) - 1} of split '{split}': {image.dtype} "
                            f"{tuple(image.shape)}, expected uint8 ({image_size}, {image_size}, 3)"
                        )
                    f.write(np.ascontiguousarray(image).tobytes())
                    tokens = tokenizer.frame(text.encode(), dtype)
                    writer.append(tokens, documents=1)
                    offsets.append(offsets[-1] + len(tokens))
            offset_file = tmp / f"{split}_offsets.bin"
            np.asarray(offsets, dtype=np.int64).tofile(offset_file)
            infos[split] = writer.close()
            images[split] = {
                "file": image_file.name,
                "num_images": len(offsets) - 1,
                "sha256": sha256_of(image_file),
                "offsets": offset_file.name,
                "offsets_sha256": sha256_of(offset_file),
            }
        manifest = manifest_of(tokenizer, dtype, infos, source)
        extra = {"image_size": image_size, IMAGES_KEY: images}
        publish(tmp, out, manifest, extra, kind=OutputKind.IMAGE_TEXT_DATASET)
        return manifest


def image_size_of(folder: pathlib.Path) -> int:
    """The image side length an image–caption dataset was written with."""
    return _image_size(_raw_manifest(folder)[1], folder)


def _image_size(raw: dict, folder: pathlib.Path) -> int:
    size = raw.get("image_size")
    if not isinstance(size, int) or size <= 0:
        raise DataError(
            f"{folder / MANIFEST}: not an image–caption dataset (no image_size); prepare one "
            "with scripts/prepare_vlm_data.py"
        )
    return size


def open_images(folder: pathlib.Path, split: str, verify: bool = True) -> ImageSplit:
    """Memory-map ``split``'s images and read its caption offsets, checking sizes (and, with
    ``verify``, checksums) against the manifest."""
    manifest, raw = _raw_manifest(folder)
    size = _image_size(raw, folder)
    info = raw.get(IMAGES_KEY, {}).get(split)
    if not isinstance(info, dict):
        raise DataError(f"{folder / MANIFEST}: no images for split '{split}'")
    path, offsets_path = folder / str(info["file"]), folder / str(info["offsets"])
    count = int(info["num_images"])
    for file, expected in ((path, count * size * size * 3), (offsets_path, (count + 1) * 8)):
        if not file.is_file() or file.stat().st_size != expected:
            raise DataError(
                f"{file}: missing or not {expected} bytes as the manifest says (truncated?); "
                "re-prepare the data with scripts/prepare_vlm_data.py"
            )
    if verify:
        for file, key in ((path, "sha256"), (offsets_path, "offsets_sha256")):
            if sha256_of(file) != info[key]:
                raise DataError(
                    f"{file}: checksum differs from the manifest (modified or corrupt); "
                    "re-prepare the data with scripts/prepare_vlm_data.py"
                )
    images = np.memmap(path, dtype=np.uint8, mode="r", shape=(count, size, size, 3))
    offsets = np.fromfile(offsets_path, dtype=np.int64)
    tokens = manifest.splits[split].num_tokens
    if offsets[0] != 0 or offsets[-1] != tokens or np.any(np.diff(offsets) <= 0):
        raise DataError(f"{offsets_path}: offsets do not match the captions; re-prepare the data")
    return ImageSplit(images, offsets)


def _raw_manifest(folder: pathlib.Path) -> tuple[Manifest, dict]:
    """The token manifest (a missing or malformed one fails here) and the raw JSON beside it."""
    manifest = read_manifest(folder)
    return manifest, json.loads((folder / MANIFEST).read_text())


class ImageCaptions:
    """One split's examples for training: example ``i`` is image ``i`` and its caption as
    ``seq_len + 1`` tokens, cut there if longer (the EOS is then lost) and padded after it
    with labels that count for nothing."""

    def __init__(self, split: ImageSplit, tokens: np.ndarray, seq_len: int) -> None:
        self.images = split.images
        self.offsets = split.offsets
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.images)

    @property
    def longest_caption(self) -> int:
        """The longest caption's length in tokens (BOS and EOS included)."""
        return int(np.diff(self.offsets).max())

    def rows(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and labels ``(len(indices), seq_len)`` of those examples (``int64``):
        labels are the inputs shifted by one, ``IGNORE_INDEX`` past the caption; inputs past
        it are 0."""
        width = self.seq_len + 1
        tokens = np.zeros((len(indices), width), dtype=np.int64)
        counted = np.zeros((len(indices), width), dtype=bool)
        for row, i in enumerate(indices):
            start, end = int(self.offsets[i]), int(self.offsets[i + 1])
            caption = self.tokens[start : min(end, start + width)]
            tokens[row, : len(caption)] = caption
            counted[row, : len(caption)] = True
        labels = np.where(counted[:, 1:], tokens[:, 1:], IGNORE_INDEX)
        return tokens[:, :-1], labels


def open_image_captions(
    folder: pathlib.Path, manifest: Manifest, split: str, seq_len: int, verify: bool
) -> ImageCaptions:
    """``split``'s images and captions, checked against the manifest (see ``open_images``)."""
    images = open_images(folder, split, verify)
    shards = open_split(folder, manifest, split, verify)
    tokens = np.concatenate(shards) if shards else np.zeros(0, dtype=np.int64)
    return ImageCaptions(images, tokens, seq_len)


def load_image(path: pathlib.Path, size: int) -> np.ndarray:
    """An image file as RGB ``uint8`` ``(size, size, 3)``: centre square, resized."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img = img.convert("RGB")
            side = min(img.size)
            left, top = (img.width - side) // 2, (img.height - side) // 2
            img = img.crop((left, top, left + side, top + side)).resize((size, size))
            return np.asarray(img, dtype=np.uint8)
    except FileNotFoundError:
        raise UserInputError(f"{path}: image file not found") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise UserInputError(f"{path}: not a readable image ({exc})") from None
