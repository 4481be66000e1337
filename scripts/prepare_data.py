"""Tokenize a corpus into token shards plus a manifest, in parallel, resumably.

Default corpus: the running interpreter's standard-library source (no download needed)::

    python scripts/prepare_data.py --out data/stdlib

Other inputs: a folder of files (each file one document), a JSONL file / folder of JSONL
files (one document per line, its text in ``--field``), Parquet or Arrow IPC files / folders of
them (one document per row, its text in the string column ``--field``), or a Hugging Face
dataset (``--hf-dataset``: a Hub name, or a local folder; Parquet, Arrow and datasets need
``pip install -e '.[data]'``); the byte tokenizer or a Hugging Face ``tokenizer.json``
(``pip install -e '.[hf]'``)::

    python scripts/prepare_data.py --input c.jsonl --field text --tokenizer tok.json --out data/c
    python scripts/prepare_data.py --hf-dataset saved/ --hf-split train --out data/d
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from forge.cli import summary
from forge.console import console_may_close
from forge.data.corpus import stdlib_root
from forge.data.hf_datasets import hf_source
from forge.data.prepare import PrepareReport, plural, prepare
from forge.data.recipe import InputFormat, Recipe, TextErrors
from forge.data.tables import import_pyarrow
from forge.data.text_inputs import find_inputs
from forge.data.tokenizer import ByteTokenizer, HFTokenizer, first_known_token
from forge.errors import UserInputError, print_errors
from forge.interrupts import exits_on_interrupt
from forge.types import ExitCode

BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|endoftext|>", "[CLS]")
EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "[SEP]")
SUFFIX_FORMATS = {
    ".jsonl": InputFormat.JSONL,
    ".json": InputFormat.JSONL,
    ".parquet": InputFormat.PARQUET,
    ".arrow": InputFormat.ARROW,
}
FORMAT_GLOBS = {InputFormat.PARQUET: "**/*.parquet", InputFormat.ARROW: "**/*.arrow"}
Inputs = tuple[tuple[str, int], ...]


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
    if args.hf_dataset is not None:
        for flag, value in (("--input", args.input), ("--format", args.format)):
            if value is not None:
                problems.append(f"{flag}: not with --hf-dataset (one input at a time)")
        if args.glob is not None:
            problems.append("--glob: not with --hf-dataset (it reads the whole split)")
    for flag, value in (("--hf-config", args.hf_config), ("--hf-split", args.hf_split)):
        if value is not None and args.hf_dataset is None:
            problems.append(f"{flag}: only with --hf-dataset")
    return problems


def input_source(args: argparse.Namespace) -> tuple[str, InputFormat, Inputs]:
    """The root folder, format and files (with sizes) of ``--input`` (or the stdlib)."""
    path = args.input or stdlib_root()
    skip = installed_package if args.input is None else (lambda p: False)
    if args.format is not None:
        fmt = InputFormat(args.format)
    elif path.is_file():
        fmt = SUFFIX_FORMATS.get(path.suffix, InputFormat.FILES)
    else:
        fmt = InputFormat.FILES
    if fmt in FORMAT_GLOBS:
        import_pyarrow(f"--input {path}")  # before any work: the missing extra in one line
    pattern = args.glob or FORMAT_GLOBS.get(fmt, "**/*.py" if args.input is None else "**/*")
    files = find_inputs(path, pattern, skip)
    root = path.parent if path.is_file() else path
    inputs = tuple((f.relative_to(root).as_posix(), f.stat().st_size) for f in files)
    return str(root.resolve()), fmt, inputs


def tokenizer_description(args: argparse.Namespace) -> dict[str, Any]:
    """What the manifest will record about ``--tokenizer`` (default: the byte tokenizer)."""
    if args.tokenizer is None:
        return ByteTokenizer().describe()
    bos = args.bos_token or first_known_token(str(args.tokenizer), BOS_CANDIDATES, "--bos-token")
    eos = args.eos_token or first_known_token(str(args.tokenizer), EOS_CANDIDATES, "--eos-token")
    return HFTokenizer(str(args.tokenizer.resolve()), bos, eos).describe()


def build_recipe(args: argparse.Namespace) -> tuple[pathlib.Path, Recipe]:
    """The inputs' root folder and the recipe, from the command line."""
    problems = option_problems(args)
    if problems:
        raise UserInputError(problems)
    split = None
    if args.hf_dataset is not None:
        source = hf_source(args.hf_dataset, args.hf_config, args.hf_split)
        root, fmt, inputs, split = source.root, source.input_format, source.inputs, source.split
    else:
        root, fmt, inputs = input_source(args)
    recipe = Recipe(
        root=root,
        inputs=inputs,
        input_format=fmt,
        field=args.field,
        tokenizer=tokenizer_description(args),
        validation_percent=args.validation_percent,
        shard_tokens=args.shard_tokens,
        errors=TextErrors(args.errors),
        hf_config=args.hf_config,
        hf_split=split,
    )
    return pathlib.Path(root), recipe


def add_input_options(parser: argparse.ArgumentParser) -> None:
    """The options that say what to read."""
    parser.add_argument(
        "--input",
        type=pathlib.Path,
        default=None,
        help="file or folder (when unset: the standard library's *.py files)",
    )
    parser.add_argument(
        "--format",
        choices=[f.value for f in InputFormat if f is not InputFormat.HF],
        default=None,
        help="files: each file is a document; jsonl: each line is; parquet, arrow: each row "
        "is (when unset: by a file's suffix .jsonl/.json, .parquet, .arrow, else files)",
    )
    parser.add_argument(
        "--hf-dataset",
        default=None,
        metavar="NAME",
        help="a Hugging Face dataset instead of --input: a folder written by save_to_disk, "
        "a local folder of data files, or a Hub name (streamed)",
    )
    parser.add_argument(
        "--hf-config", default=None, help="--hf-dataset: the configuration (unset: its default)"
    )
    parser.add_argument("--hf-split", default=None, help="--hf-dataset: the split (unset: train)")
    parser.add_argument(
        "--field", default="text", help="JSONL field, or table column, holding the text"
    )
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
        help="files to read under a folder (unset: **/*; parquet: **/*.parquet; arrow: "
        "**/*.arrow; stdlib: **/*.py)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line: output, input, tokenizer, splits and parallelism."""
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("data/stdlib"), help="dataset folder"
    )
    add_input_options(parser)
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
    return parser


@console_may_close()
@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    print_summary(args, report)
    return ExitCode.OK


def print_summary(args: argparse.Namespace, report: PrepareReport) -> None:
    """What was written (or that nothing needed to be), what was skipped, and warnings."""
    manifest = report.manifest
    if manifest is None:
        print(f"{args.out} already holds this dataset; nothing to do")
        return
    if report.reused_units:
        print(f"resumed: {report.reused_units} units were already tokenized")
    for split, info in manifest.splits.items():
        print(f"{split}: {info.num_documents} documents, {info.num_tokens:,} tokens")
    if report.skipped_binary:
        print(f"skipped {report.skipped_binary} binary files (a NUL byte in the first 8 KiB)")
    if report.skipped_null:
        nulls = plural(report.skipped_null, "null text")
        print(f"skipped {nulls} (rows whose '{args.field}' is null)")
    validation = manifest.splits.get("validation")
    if validation is None or validation.num_documents == 0:
        print(
            "warning: the validation split is empty; train with --eval.interval=0, or prepare "
            "again with a larger --validation-percent",
            file=sys.stderr,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
