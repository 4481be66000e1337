"""Convert between forge checkpoints and a Hugging Face Llama export (safetensors + config.json).

    python scripts/convert_checkpoint.py export runs/debug --out exports/debug --dtype bfloat16
    python scripts/convert_checkpoint.py import exports/debug --out ckpt/imported

``export`` reads the run's newest complete checkpoint (the training resolver); ``import``
writes a model-only forge checkpoint (``<out>/step_0``) to use as ``checkpoint.load_path``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from forge.checkpoint.export import (
    DTYPES,
    TokenizerInfo,
    export_model,
    import_model,
    tokenizer_info,
)
from forge.checkpoint.resume import load_newest_weights
from forge.checkpoint.store import save_model_only
from forge.config import JobConfig
from forge.config.loader import CONVERTER
from forge.config.toml_writer import dumps_toml
from forge.data.shards import MANIFEST, read_manifest
from forge.errors import UserInputError, print_errors
from forge.model.transformer import Transformer
from forge.optim.optimizers import evaluation_weights
from forge.optim.param_groups import inference_optimizer
from forge.outputs import OutputKind, output_problem, replace_output, staged_output
from forge.training.run_dir import checkpoint_dir_of, load_run_config
from forge.types import ExitCode


def check_output(out: pathlib.Path, kind: OutputKind, overwrite: bool) -> None:
    """Refuse an ``--out`` this command may not write (``output_problem``), before reading."""
    problem = output_problem(out, kind, overwrite)
    if problem is not None:
        raise UserInputError(problem)


def export(run_dir: pathlib.Path, out: pathlib.Path, dtype: str, overwrite: bool) -> None:
    check_output(out, OutputKind.HF_EXPORT, overwrite)
    config = load_run_config(run_dir)
    if config.model.vlm is not None:
        raise UserInputError(
            [
                f"{run_dir}: a vision-language run (model.vlm) has no Hugging Face export; "
                "its checkpoints serve scripts/generate.py --image and scripts/eval.py"
            ]
        )
    model = Transformer(config.model)
    optimizer = inference_optimizer(model, config.optimizer)
    path = load_newest_weights(checkpoint_dir_of(config, run_dir), None, model, report, optimizer)
    with evaluation_weights(optimizer):
        export_model(model.state_dict(), config.model, out, dtype, run_tokenizer_info(config))
    print(f"exported {path} to {out} ({dtype})")


def run_tokenizer_info(config: JobConfig) -> TokenizerInfo:
    """The special ids (and HF tokenizer file) of the run's data, if its manifest is there."""
    folder = pathlib.Path(config.data.source_list[0].path)
    if not (folder / MANIFEST).is_file():
        return TokenizerInfo()
    return tokenizer_info(read_manifest(folder).tokenizer)


def report(line: str) -> None:
    print(line, file=sys.stderr)


def import_(folder: pathlib.Path, out: pathlib.Path, overwrite: bool) -> None:
    check_output(out, OutputKind.IMPORTED_CHECKPOINT, overwrite)
    cfg, state = import_model(folder)
    model = Transformer(cfg)
    model.load_state_dict(state)
    with staged_output(out) as tmp:  # the whole checkpoint folder, renamed into place
        save_model_only(tmp, 0, model, {"step": 0, "imported_from": str(folder)})
        replace_output(tmp, out, OutputKind.IMPORTED_CHECKPOINT)
    path = out / "step_0"
    print(f"wrote {path}; use it with --checkpoint.load_path={path} and this [model] section:")
    model = {k: v for k, v in CONVERTER.unstructure(cfg).items() if v is not None}
    print(dumps_toml({"model": model}).strip())


OVERWRITE_HELP = "replace an earlier output of this command in --out (nothing else is replaced)"


def main(argv: Sequence[str] | None = None) -> int:
    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=defaults)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser(
        "export", help="forge run -> safetensors + config.json", formatter_class=defaults
    )
    ex.add_argument("run_dir", type=pathlib.Path, help="a run folder holding config.toml")
    ex.add_argument("--out", type=pathlib.Path, required=True, help="folder to write")
    ex.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the weights"
    )
    ex.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    im = sub.add_parser(
        "import", help="safetensors + config.json -> forge checkpoint", formatter_class=defaults
    )
    im.add_argument("folder", type=pathlib.Path, help="a Llama export (config.json + safetensors)")
    im.add_argument(
        "--out", type=pathlib.Path, required=True, help="checkpoint folder to write (step_0)"
    )
    im.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            export(args.run_dir, args.out, args.dtype, args.overwrite)
        else:
            import_(args.folder, args.out, args.overwrite)
    except UserInputError as exc:
        print_errors(exc.lines)
        return ExitCode.CONFIG_ERROR
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
