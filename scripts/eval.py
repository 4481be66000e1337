"""Held-out loss of a trained model: ``python scripts/eval.py runs/debug [--data DIR]``.

Takes a run directory (the checkpoint training would resume from, found by the same resolver)
or one checkpoint directory (``runs/debug/checkpoints/step_400``), and computes the mean loss
and perplexity over every window of a prepared split (``--split validation`` of ``--data``,
by default the run's own data); for a vision-language run, over every caption of the split
with its image (``--mismatched-images``: with the next example's image instead). Under
``torchrun --nproc_per_node=N`` each rank evaluates every N-th window (or caption) and the
sums are combined, so the result is the same at any rank count. Each rank runs on
``cuda:<local rank>`` where torch sees GPUs (NCCL between ranks), else on the CPU (gloo);
``--device`` and ``--dtype`` override the device and the weights' dtype (default: the
checkpoint's).
"""

from __future__ import annotations

import argparse
import pathlib

from forge.cli import add_device_options, help_first, run_path, summary


def parser() -> argparse.ArgumentParser:
    """The options ``main`` reads, built before torch is imported (``help_first``)."""
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("path", type=run_path, help="a run directory or one checkpoint")
    parser.add_argument("--data", type=pathlib.Path, default=None, help="a prepared dataset")
    parser.add_argument("--split", default="validation", help="which split of --data")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--mismatched-images",
        action="store_true",
        help="a vision-language run: give each caption the next example's image",
    )
    add_device_options(parser)
    return parser


help_first(__name__, lambda args: parser().parse_args(args))

import json
import math
import sys
from collections.abc import Sequence

import attrs
import torch

from forge.console import console_may_close
from forge.data.batch import Batch
from forge.data.dataset import open_windows
from forge.data.image_text import ImageCaptions, open_image_captions
from forge.data.loader import caption_batch
from forge.data.shards import read_manifest
from forge.errors import UserInputError, print_errors
from forge.interrupts import exits_on_interrupt
from forge.model.chunked_loss import loss_spec_of
from forge.optim.optimizers import evaluation_weights
from forge.parallel.devices import DeviceChoice, run_on_chosen_device, start_script_world
from forge.parallel.world import WorldInfo
from forge.training.evaluation.evaluate import evaluate_totals, totals_over_ranks
from forge.training.evaluation.inference import load_for_inference, run_dir_of
from forge.training.records.run_dir import load_run_config
from forge.training.setup.vlm import mismatched_images
from forge.types import ExitCode


def batches_of(windows, rank: int, world: int, batch_size: int) -> list[Batch]:
    """This rank's windows (every ``world``-th from ``rank``), in batches of ``batch_size``."""
    mine = list(range(rank, len(windows), world))
    out = []
    for start in range(0, len(mine), batch_size):
        rows = torch.stack(
            [torch.from_numpy(windows[i].astype("int64")) for i in mine[start : start + batch_size]]
        )
        out.append(Batch(rows[:, :-1], rows[:, 1:]))
    return out


def caption_batches_of(
    captions: ImageCaptions, rank: int, world: int, batch_size: int
) -> list[Batch]:
    """This rank's image–caption examples (every ``world``-th from ``rank``) with their
    images, in batches of ``batch_size``."""
    mine = list(range(rank, len(captions), world))
    return [
        caption_batch(captions, mine[start : start + batch_size])
        for start in range(0, len(mine), batch_size)
    ]


def report(line: str) -> None:
    print(line, file=sys.stderr)


@console_may_close()
@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    return run_on_chosen_device(parser().parse_args(argv), evaluate)


def evaluate(args: argparse.Namespace, world: WorldInfo, choice: DeviceChoice) -> int:
    """The evaluation ``main`` describes, on ``choice``'s device; the exit code."""
    try:
        if choice.problem is not None:
            raise UserInputError([choice.problem])
        if args.batch_size < 1:
            raise UserInputError([f"--batch-size: must be >= 1, got {args.batch_size}"])
        run_dir, checkpoint = run_dir_of(args.path)
        config = load_run_config(run_dir)
        data = args.data or pathlib.Path(config.data.source_list[0].path)
        manifest = read_manifest(data)  # a DataError is a UserInputError: one line
        if args.split not in manifest.splits:
            splits = sorted(manifest.splits)
            raise UserInputError([f"{data}: no split {args.split!r}; it has {splits}"])
        if config.model.vlm is not None:
            examples = open_image_captions(data, manifest, args.split, config.train.seq_len, True)
        else:
            if args.mismatched_images:
                raise UserInputError(["--mismatched-images: the run is a text model (no images)"])
            examples = open_windows(data, manifest, args.split, config.train.seq_len, True)
        if manifest.vocab_size > config.model.vocab_size:
            raise UserInputError(
                [f"{data}: vocab size {manifest.vocab_size} is larger than the model's "
                 f"{config.model.vocab_size}; evaluate on data prepared with its tokenizer"]
            )  # fmt: skip
        device = start_script_world(world, choice, config.distributed.timeout_s)
        loaded = load_for_inference(config, run_dir, checkpoint, device, args.dtype, report)
    except UserInputError as exc:
        if world.rank == 0 or choice.problem is not None:  # a rank of its own: it says so
            print_errors(exc.lines)
        return ExitCode.CONFIG_ERROR
    if isinstance(examples, ImageCaptions):
        batches = caption_batches_of(examples, world.rank, world.world_size, args.batch_size)
        if args.mismatched_images:
            batches = [mismatched_images(b) for b in batches]
    else:
        batches = batches_of(examples, world.rank, world.world_size, args.batch_size)
    with evaluation_weights(loaded.optimizer):
        on_device = (b.to(device) for b in batches)  # one batch on the device at a time
        precision, loss = config.train.mixed_precision, loss_spec_of(config)
        totals = evaluate_totals(loaded.model, on_device, precision, loss)
    # the loss and its count only: a rank without batches has no expert loads to add
    totals = totals_over_ranks(attrs.evolve(totals, moe_loads=None), world.world_size, device)
    loss, count = totals.loss_sum / totals.count, totals.count
    if world.rank == 0:
        result = {
            "checkpoint": str(loaded.checkpoint),
            "data": str(data),
            "split": args.split,
            "tokens": int(count),
            "loss": loss,
            "perplexity": math.exp(loss),
            "device": choice.device,
            "dtype": str(loaded.dtype).removeprefix("torch."),
        }
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"{args.split} loss {loss:.4f} | perplexity {math.exp(loss):.3f} | "
                f"{int(count):,} tokens | {loaded.checkpoint}"
            )
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
