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
from forge.data.prepare import InputFormat, Recipe, TextErrors, find_inputs, prepare
from forge.data.tokenizer import ByteTokenizer, HFTokenizer, first_known_token
from forge.errors import UserInputError, print_errors
from forge.types import ExitCode

BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|endoftext|>", "[CLS]")
EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "[SEP]")


def installed_package(path: pathlib.Path) -> bool:
    return "site-packages" in path.parts or "dist-packages" in path.parts


def option_problems(args: argparse.Namespace) -> list[str]:
    """Out-of-range numeric options, one line each."""
    problems = []
    if not 0.0 <= args.validation_percent <= 100.0:  # NaN fails too
        problems.append(f"--validation-percent: must be in [0, 100], got {args.validation_percent}")
    if args.shard_tokens <= 0:
        problems.append(f"--shard-tokens: must be > 0, got {args.shard_tokens}")
    if args.workers <= 0:
        problems.append(f"--workers: must be >= 1, got {args.workers}")
    return problems


def build_recipe(args: argparse.Namespace) -> tuple[pathlib.Path, Recipe]:
    """The inputs' root folder and the recipe, from the command line."""
    problems = option_problems(args)
    if problems:
        raise UserInputError(problems)
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
        errors=TextErrors(args.errors),
    )
    return root, recipe


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("data/stdlib"), help="dataset folder"
    )
    parser.add_argument(
        "--input",
        type=pathlib.Path,
        default=None,
        help="file or folder (when unset: the standard library's *.py files)",
    )
    parser.add_argument(
        "--format",
        choices=[f.value for f in InputFormat],
        default=None,
        help="files: each file is a document; jsonl: each line is "
        "(when unset: jsonl for a .jsonl/.json file, else files)",
    )
    parser.add_argument("--field", default="text", help="JSONL field holding the text")
    parser.add_argument(
        "--errors",
        choices=[e.value for e in TextErrors],
        default=TextErrors.STRICT.value,
        help="a JSONL line that is not UTF-8: strict refuses it (naming file and line), "
        "replace decodes bad bytes as U+FFFD",
    )
    parser.add_argument(
        "--glob",
        default=None,
        help="files to read under a folder (unset: **/*, stdlib: **/*.py)",
    )
    parser.add_argument(
        "--tokenizer",
        type=pathlib.Path,
        default=None,
        help="a Hugging Face tokenizer.json (when unset: the byte tokenizer)",
    )
    parser.add_argument(
        "--bos-token",
        default=None,
        help="HF tokenizer: the document-start token (unset: guess)",
    )
    parser.add_argument(
        "--eos-token", default=None, help="HF tokenizer: the document-end token (when unset: guess)"
    )
    parser.add_argument(
        "--validation-percent",
        type=float,
        default=2.0,
        help="share of documents held out for evaluation, 0 to 100",
    )
    parser.add_argument("--shard-tokens", type=int, default=1 << 24, help="tokens per shard")
    parser.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="tokenizer processes (the dataset does not depend on it)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args(argv)  # fmt: skip
    try:
        root, recipe = build_recipe(args)
        report = prepare(
            args.out, root, recipe, args.workers, progress=None if args.quiet else sys.stderr
        )
    except UserInputError as exc:
        print_errors(exc.lines)
        return ExitCode.CONFIG_ERROR
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: the finished units are kept in {args.out}.tmp; run the same "
            "command again to resume",
            file=sys.stderr,
        )
        return ExitCode.INTERRUPTED
    manifest = report.manifest
    if manifest is None:
        print(f"{args.out} already holds this dataset; nothing to do")
        return ExitCode.OK
    if report.reused_units:
        print(f"resumed: {report.reused_units} units were already tokenized")
    for split, info in manifest.splits.items():
        print(f"{split}: {info.num_documents} documents, {info.num_tokens:,} tokens")
    if report.skipped_binary:
        print(f"skipped {report.skipped_binary} binary files (a NUL byte in the first 8 KiB)")
    validation = manifest.splits.get("validation")
    if validation is None or validation.num_documents == 0:
        print(
            "warning: the validation split is empty; train with --eval.interval=0, or prepare "
            "again with a larger --validation-percent",
            file=sys.stderr,
        )
    print(f"wrote {args.out}")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
