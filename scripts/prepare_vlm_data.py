"""Write an image–caption dataset: procedural shapes (no download), or your own pairs.

Default: ``--n`` images of coloured shapes with captions that describe them, deterministic
from ``--seed`` (``forge/data/scenes.py``), a held-out ``validation`` split beside ``train``::

    python scripts/prepare_vlm_data.py --out data/shapes [--n 20000] [--image-size 32]

Your own: a folder of ``<name>.<png|jpg|...>`` + ``<name>.txt`` pairs, or a JSONL file of
``{"image_path": ..., "caption": ...}`` lines (paths relative to the file); each image is
centre-cropped to a square and resized. Needs Pillow (``pip install -e '.[vision]'``)::

    python scripts/prepare_vlm_data.py --input pairs/ --out data/mine --image-size 64
"""

from __future__ import annotations

import argparse
import pathlib

from forge.cli import help_first, summary


def parser() -> argparse.ArgumentParser:
    """The options ``main`` reads, built before torch is imported (``help_first``)."""
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("data/shapes"))
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier dataset of this script in --out (nothing else is replaced)",
    )
    parser.add_argument(
        "--input", type=pathlib.Path, default=None, help="your pairs (unset: procedural shapes)"
    )
    parser.add_argument("--n", type=int, default=20000, help="procedural images")
    parser.add_argument("--image-size", type=int, default=32, help="side length in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--validation-percent", type=float, default=5.0, help="share held out, 0 to 100"
    )
    return parser


help_first(__name__, lambda args: parser().parse_args(args))

import importlib.util
import json
import sys
import zlib
from collections.abc import Sequence

from forge.console import console_may_close
from forge.data.image_text import load_image, write_image_text_dataset
from forge.data.scenes import procedural_pairs
from forge.data.tokenizer import ByteTokenizer
from forge.errors import UserInputError, print_errors
from forge.interrupts import exits_on_interrupt
from forge.outputs import OutputKind, output_problem
from forge.types import ExitCode

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


def option_problems(args: argparse.Namespace) -> list[str]:
    """Out-of-range options, one line each."""
    problems = []
    if args.n <= 0:
        problems.append(f"--n: must be > 0, got {args.n}")
    if not 4 <= args.image_size <= 1024:
        problems.append(f"--image-size: must be in [4, 1024], got {args.image_size}")
    if not 0.0 < args.validation_percent < 100.0:  # NaN fails too
        problems.append(
            f"--validation-percent: must be in (0, 100) (both splits hold examples), got "
            f"{args.validation_percent}"
        )
    if not 0 <= args.seed < 2**32 - 1_000_003:  # numpy's seeds; validation's is seed + 1000003
        problems.append(f"--seed: must be in [0, {2**32 - 1_000_003}), got {args.seed}")
    return problems


def split_of(key: str, validation_percent: float) -> str:
    """``validation`` for a stable ``validation_percent`` share of keys, else ``train``."""
    bucket = zlib.crc32(key.encode()) % 10_000
    return "validation" if bucket < validation_percent * 100 else "train"


def listed_pairs(path: pathlib.Path) -> list[tuple[pathlib.Path, str, str]]:
    """``(image, caption, key)`` of a folder of image + ``.txt`` pairs or a JSONL file."""
    if path.is_file():
        pairs = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                image, text = path.parent / row["image_path"], row["caption"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserInputError(
                    f"{path}:{number}: expected a JSON object with image_path and caption"
                ) from None
            if not isinstance(text, str):
                raise UserInputError(f"{path}:{number}: caption must be a string")
            pairs.append((image, text, str(row["image_path"])))
        return pairs
    if not path.is_dir():
        raise UserInputError(f"--input {path}: no such file or folder")
    pairs = []
    for image in sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
        text_file = image.with_suffix(".txt")
        if not text_file.is_file():
            raise UserInputError(f"{image}: no caption file {text_file.name} beside it")
        pairs.append((image, text_file.read_text().strip(), image.relative_to(path).as_posix()))
    if not pairs:
        raise UserInputError(f"--input {path}: no images ({', '.join(IMAGE_SUFFIXES)}) found")
    return pairs


@console_may_close()
@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        problems = option_problems(args)
        if problems:
            raise UserInputError(problems)
        problem = output_problem(args.out, OutputKind.IMAGE_TEXT_DATASET, args.overwrite)
        if problem is not None:
            raise UserInputError(problem)
        size = args.image_size
        if args.input is None:
            n_val = max(1, round(args.n * args.validation_percent / 100))
            splits = {  # separate generators: the held-out scenes are drawn independently
                "train": procedural_pairs(args.n - n_val, size, args.seed),
                "validation": procedural_pairs(n_val, size, args.seed + 1_000_003),
            }
            source = f"procedural shapes, seed {args.seed}, {args.n} images"
        else:
            if importlib.util.find_spec("PIL") is None:
                raise UserInputError(
                    "--input: reading images needs Pillow; pip install -e '.[vision]'"
                )
            pairs = listed_pairs(args.input)
            splits = {
                name: [
                    (load_image(image, size), text)
                    for image, text, key in pairs
                    if split_of(key, args.validation_percent) == name
                ]
                for name in ("train", "validation")
            }
            source = str(args.input.resolve())
        try:
            manifest = write_image_text_dataset(args.out, splits, ByteTokenizer(), size, source)
        except OSError as exc:  # a full disk, no permission: the temporary folder is gone
            raise UserInputError(f"--out {args.out}: cannot write the dataset ({exc})") from None
    except UserInputError as exc:
        print_errors(exc.lines)
        return ExitCode.CONFIG_ERROR
    counts = {name: info.num_documents for name, info in manifest.splits.items()}
    print(f"[forge] wrote {args.out}: {counts} image-caption pairs, {size}x{size}")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
