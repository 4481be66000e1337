"""Tokenize a corpus into token shards plus a manifest.

Default corpus: the running interpreter's standard-library source (no download needed)::

    python scripts/prepare_data.py --out data/stdlib
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from forge.data.corpus import iter_documents, split_of, stdlib_files, stdlib_root
from forge.data.shards import write_dataset
from forge.data.tokenizer import ByteTokenizer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("data/stdlib"))
    parser.add_argument(
        "--input",
        type=pathlib.Path,
        default=None,
        help="folder of *.py files to use instead of the standard library",
    )
    parser.add_argument("--validation-percent", type=float, default=2.0)
    args = parser.parse_args(argv)
    root = args.input or stdlib_root()
    if not root.is_dir():
        print(f"error: --input {root}: not a folder", file=sys.stderr)
        return 2
    files = stdlib_files(root)
    if not files:
        print(f"error: --input {root}: holds no *.py files", file=sys.stderr)
        return 2
    names = {f: f.relative_to(root).as_posix() for f in files}
    splits = {
        split: iter_documents(
            root, [f for f in files if split_of(names[f], args.validation_percent) == split]
        )
        for split in ("train", "validation")
    }
    manifest = write_dataset(args.out, splits, ByteTokenizer(), source=str(root))
    for split, info in manifest.splits.items():
        print(f"{split}: {info.num_documents} documents, {info.num_tokens:,} tokens")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
