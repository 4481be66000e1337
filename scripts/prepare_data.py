"""Tokenize a corpus into token shards plus a manifest, in parallel, resumably.

Default corpus: the running interpreter's standard-library source (no download needed)::

    python scripts/prepare_data.py --out data/stdlib

Other inputs: a folder of files (each file one document), or a JSONL file / folder of JSONL
files (one document per line, its text in ``--field``); the byte tokenizer or a Hugging Face
``tokenizer.json`` (``pip install -e '.[hf]'``)::

    python scripts/prepare_data.py --input c.jsonl --field text --tokenizer tok.json --out data/c
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Sequence

from forge.data.corpus import stdlib_root
from forge.data.prepare import InputFormat, Recipe, find_inputs, prepare
from forge.data.tokenizer import ByteTokenizer, HFTokenizer, first_known_token
from forge.errors import UserInputError

BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|endoftext|>", "[CLS]")
EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "[SEP]")


def installed_package(path: pathlib.Path) -> bool:
    return "site-packages" in path.parts or "dist-packages" in path.parts


def build_recipe(args: argparse.Namespace) -> tuple[pathlib.Path, Recipe]:
    """The inputs' root folder and the recipe, from the command line."""
    path = args.input or stdlib_root()
    skip = installed_package if args.input is None else (lambda p: False)
    if args.format is not None:
        fmt = InputFormat(args.format)
    elif path.is_file() and path.suffix in (".jsonl", ".json"):
        fmt = InputFormat.JSONL
    else:
        fmt = InputFormat.FILES
    pattern = args.glob or ("**/*.py" if args.input is None else "**/*")
    files = find_inputs(path, pattern, skip)
    root = path.parent if path.is_file() else path
    if args.tokenizer is None:
        tokenizer = ByteTokenizer().describe()
    else:
        bos = args.bos_token or first_known_token(
            str(args.tokenizer), BOS_CANDIDATES, "--bos-token"
        )
        eos = args.eos_token or first_known_token(
            str(args.tokenizer), EOS_CANDIDATES, "--eos-token"
        )
        tokenizer = HFTokenizer(str(args.tokenizer.resolve()), bos, eos).describe()
    recipe = Recipe(
        root=str(root.resolve()),
        inputs=tuple((f.relative_to(root).as_posix(), f.stat().st_size) for f in files),
        input_format=fmt,
        field=args.field,
        tokenizer=tokenizer,
        validation_percent=args.validation_percent,
        shard_tokens=args.shard_tokens,
    )
    return root, recipe


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("data/stdlib"))
    parser.add_argument(
        "--input",
        type=pathlib.Path,
        default=None,
        help="file or folder (default: the standard library's *.py files)",
    )
    parser.add_argument(
        "--format",
        choices=[f.value for f in InputFormat],
        default=None,
        help="files: each file is a document; jsonl: each line is "
        "(default: jsonl for a .jsonl/.json file, else files)",
    )
    parser.add_argument("--field", default="text", help="JSONL field holding the text")
    parser.add_argument(
        "--glob", default=None, help="files to read under a folder (default **/*, stdlib: **/*.py)"
    )
    parser.add_argument(
        "--tokenizer",
        type=pathlib.Path,
        default=None,
        help="a Hugging Face tokenizer.json (default: byte tokenizer)",
    )
    parser.add_argument("--bos-token", default=None)
    parser.add_argument("--eos-token", default=None)
    parser.add_argument("--validation-percent", type=float, default=2.0)
    parser.add_argument("--shard-tokens", type=int, default=1 << 24)
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args(argv)  # fmt: skip
    try:
        root, recipe = build_recipe(args)
        manifest, reused = prepare(
            args.out, root, recipe, args.workers, progress=None if args.quiet else sys.stderr
        )
    except UserInputError as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if manifest is None:
        print(f"{args.out} already holds this dataset; nothing to do")
        return 0
    if reused:
        print(f"resumed: {reused} units were already tokenized")
    for split, info in manifest.splits.items():
        print(f"{split}: {info.num_documents} documents, {info.num_tokens:,} tokens")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
