"""Convert between forge checkpoints and Hugging Face folders (safetensors + config.json).

    python scripts/convert_checkpoint.py export runs/debug --out exports/debug --dtype bfloat16
    python scripts/convert_checkpoint.py import exports/debug --out ckpt/imported

Both directions take the DeepSeek-V3, Llama, Mixtral, Qwen3 and Qwen3-MoE families
(``forge.interop.families``; docs/interop.md). ``export`` reads the run's newest
complete checkpoint (the training resolver) on the CPU (``--device cuda`` or ``auto`` to read
it onto a GPU), in the checkpoint's dtype, and writes it in ``--dtype``; ``import`` writes a
model-only forge checkpoint (``<out>/step_0``) to use as ``checkpoint.load_path``. Both are
file conversions for one process: under ``torchrun`` rank 0 converts and the other ranks exit
at once.
"""

from __future__ import annotations

import argparse
import pathlib

from forge.cli import DeviceRequest, add_device_options, help_first, run_path, summary
from forge.config.checkpoint import ExportDtype

OVERWRITE_HELP = "replace an earlier output of this command in --out (nothing else is replaced)"


def parser() -> argparse.ArgumentParser:
    """The commands and their options, built before torch is imported (``help_first``)."""
    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=summary(__doc__), formatter_class=defaults)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser(
        "export", help="forge run -> safetensors + config.json", formatter_class=defaults
    )
    ex.add_argument(
        "run_dir", type=run_path, help="a run directory or one checkpoint (step_N folder)"
    )
    ex.add_argument("--out", type=pathlib.Path, required=True, help="folder to write")
    ex.add_argument(
        "--dtype",
        choices=sorted(d.value for d in ExportDtype),
        default="bfloat16",
        help="dtype of the weights",
    )
    ex.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    im = sub.add_parser(
        "import", help="safetensors + config.json -> forge checkpoint", formatter_class=defaults
    )
    im.add_argument(
        "folder",
        type=pathlib.Path,
        help="a DeepSeek-V3, Llama, Mixtral, Qwen3 or Qwen3-MoE folder (config.json + safetensors)",
    )
    im.add_argument(
        "--out", type=pathlib.Path, required=True, help="checkpoint folder to write (step_0)"
    )
    im.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    add_device_options(ex, dtype=False, default=DeviceRequest.CPU)
    return parser


help_first(__name__, lambda args: parser().parse_args(args))

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence

import torch

from forge.checkpoint.store import save_model_only
from forge.config import JobConfig, ModelConfig
from forge.config.loader import CONVERTER
from forge.config.toml_writer import dumps_toml
from forge.console import console_may_close
from forge.data.shards import MANIFEST, read_manifest
from forge.errors import UserInputError, one_line, print_errors
from forge.interop.export import (
    TokenizerInfo,
    export_model,
    require_safetensors,
    tokenizer_info,
)
from forge.interop.export_rules import export_caveats, export_family
from forge.interop.hf_import import import_model
from forge.interrupts import exits_on_interrupt
from forge.model.transformer import Transformer
from forge.model.vlm import empty_model
from forge.optim.optimizers import evaluation_weights
from forge.optim.param_groups import inference_optimizer
from forge.outputs import OutputKind, output_problem, replace_output, staged_output
from forge.parallel.devices import DeviceChoice, choose_device, start_script_world, stored_dtype
from forge.parallel.world import WorldInfo, world_info
from forge.training.evaluation.inference import load_run_weights, run_dir_of
from forge.training.records.run_dir import load_run_config
from forge.types import ExitCode


@contextlib.contextmanager
def writing_to(out: pathlib.Path, kind: OutputKind) -> Iterator[None]:
    """One line naming ``--out`` for a write that fails: a folder that cannot be created
    (below a file, not writable), a full disk, a file-size limit. ``staged_output`` has
    removed what was written by then, and an earlier output stays as it was."""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (OSError, SafetensorError, CheckpointException) as exc:
        raise UserInputError(
            f"--out {out}: the {kind.noun} could not be written ({one_line(exc)}); nothing was "
            "left there: free space or choose another --out"
        ) from None


def check_output(out: pathlib.Path, kind: OutputKind, overwrite: bool) -> None:
    """Refuse an ``--out`` this command may not write (``output_problem``), before reading."""
    problem = output_problem(out, kind, overwrite)
    if problem is not None:
        raise UserInputError(problem)


def export(
    path: pathlib.Path, out: pathlib.Path, dtype: str, overwrite: bool, choice: DeviceChoice
) -> None:
    """Write the run's newest checkpoint (or the checkpoint ``path`` names) to ``out`` as a
    Hugging Face export, reading it onto ``choice``'s device."""
    require_safetensors()
    if choice.problem is not None:
        raise UserInputError(choice.problem)
    check_output(out, OutputKind.HF_EXPORT, overwrite)
    run_dir, checkpoint = run_dir_of(path)
    config = load_run_config(run_dir)
    if config.model.vlm is not None:
        raise UserInputError(
            [
                f"{run_dir}: a vision-language run (model.vlm) has no Hugging Face export; "
                "its checkpoints serve scripts/generate.py --image and scripts/eval.py"
            ]
        )
    for caveat in export_caveats(config.model):
        print(f"warning: {caveat}", file=sys.stderr)
    device = start_script_world(WorldInfo(), choice)  # one process reads: no group
    model = empty_model(config.model, device, stored_dtype(config.train.param_dtype))
    optimizer = inference_optimizer(model, config.optimizer)
    used = load_run_weights(config, run_dir, checkpoint, model, optimizer, report)
    with evaluation_weights(optimizer), writing_to(out, OutputKind.HF_EXPORT):
        export_model(model.state_dict(), config.model, out, dtype, run_tokenizer_info(config))
    print(f"exported {used} to {out} ({dtype})")


def run_tokenizer_info(config: JobConfig) -> TokenizerInfo:
    """The special ids (and HF tokenizer file) of the run's data, if its manifest is there."""
    folder = pathlib.Path(config.data.source_list[0].path)
    if not (folder / MANIFEST).is_file():
        return TokenizerInfo()
    return tokenizer_info(read_manifest(folder).tokenizer)


def report(line: str) -> None:
    print(line, file=sys.stderr)


def imported_model(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Transformer:
    """The forge model holding ``state``: built on the meta device and handed the imported
    tensors, so that nothing is initialised only to be overwritten and no RoPE table is
    computed (a checkpoint saves neither)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(state, assign=True)  # strict: every name, every shape
    if cfg.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight  # one parameter, as training has it
    return model


def import_(folder: pathlib.Path, out: pathlib.Path, overwrite: bool) -> None:
    """Write ``folder`` (a Hugging Face model) as the model-only checkpoint ``out/step_0``;
    every problem with the folder is found (``import_model``) before ``out`` is written."""
    require_safetensors()
    check_output(out, OutputKind.IMPORTED_CHECKPOINT, overwrite)
    cfg, state = import_model(folder)
    model = imported_model(cfg, state)
    kind = OutputKind.IMPORTED_CHECKPOINT
    with writing_to(out, kind), staged_output(out) as tmp:  # renamed into place whole
        save_model_only(tmp, 0, model, {"step": 0, "imported_from": str(folder)})
        replace_output(tmp, out, kind)
    path = out / "step_0"
    family = export_family(cfg).label
    print(
        f"wrote {path} (a {family} model); use it with --checkpoint.load_path={path} and this "
        "[model] section:"
    )
    model = {k: v for k, v in CONVERTER.unstructure(cfg).items() if v is not None}
    print(dumps_toml({"model": model}).strip())


@console_may_close()
@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    problems = convert(args, world_info(os.environ))
    if problems:
        print_errors(problems)
        return ExitCode.CONFIG_ERROR
    return ExitCode.OK


def convert(args: argparse.Namespace, world: WorldInfo) -> list[str]:
    """Run the command on rank 0 (a file conversion needs one process; under torchrun the
    other ranks check nothing and exit); the problems that end it, none if it succeeded."""
    if world.rank != 0:
        return []
    try:
        if args.command == "export":
            cuda, gpus = torch.cuda.is_available(), torch.cuda.device_count()
            choice = choose_device(args.device, cuda, gpus, world.local_rank)
            export(args.run_dir, args.out, args.dtype, args.overwrite, choice)
        else:
            import_(args.folder, args.out, args.overwrite)
    except UserInputError as exc:
        return exc.lines
    return []


if __name__ == "__main__":
    sys.exit(main())
