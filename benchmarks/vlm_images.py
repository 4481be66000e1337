"""Does the vision-language model use the image? Caption loss with and without it.

Trains the config's model twice from the same start, composing forge's phases as a notebook
would: once on matched (image, caption) pairs, once with every batch's images rolled by one
row (each caption beside another image: the text-only baseline, the same captions and the
same model, with images that carry no information about them). Then the held-out caption
loss of each, and of the first with mismatched images::

    python benchmarks/vlm_images.py [configs/train/vlm_debug.toml] [--train.max_steps=300]

A model that reads the image has a matched loss well below the baseline, and its loss with
mismatched images above it (the image then points at the wrong words).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence

import attrs

from forge.data.batch import Batch
from forge.training.evaluation.evaluate import evaluate_loss
from forge.training.setup.loaders import train_batches
from forge.training.setup.phases import (
    build_model_and_optim,
    load_and_validate_config,
    setup_data,
    setup_distributed,
)
from forge.training.setup.vlm import mismatched_images
from forge.training.steps.select import make_step_fn
from forge.types import LoopState

DEFAULT_CONFIG = "configs/train/vlm_debug.toml"


@attrs.frozen
class CaptionLosses:
    """Held-out caption cross-entropy (nats per token) of one trained model."""

    matched: float  # each caption beside its own image
    mismatched: float  # each caption beside another row's image
    seconds: float  # training time


def train_and_evaluate(argv: Sequence[str], mismatch_training: bool) -> CaptionLosses:
    """Train ``argv``'s config to ``train.max_steps`` (no checkpoints, no run directory),
    with images mismatched during training if asked; evaluate on ``eval.steps`` batches."""
    run = load_and_validate_config(argv)
    dist = setup_distributed(run)
    model = build_model_and_optim(run, dist)
    data = setup_data(run, dist)
    step_fn = make_step_fn(run, dist, model, data)
    steps: Iterator[tuple[Batch, ...]] = train_batches(data, run.config.train.grad_accum_steps)
    state = LoopState()
    start = time.perf_counter()
    for batches in steps:
        if state.step >= run.config.train.max_steps:
            break
        if mismatch_training:
            batches = tuple(mismatched_images(b) for b in batches)
        step_fn(batches, state)
        state = attrs.evolve(state, step=state.step + 1)
    seconds = time.perf_counter() - start
    data.train_loader.close()
    assert data.eval_loader is not None, "set eval.interval > 0: the held-out split is read"
    held_out = [b for _, b in zip(range(run.config.eval.steps), data.eval_loader, strict=False)]
    precision = run.config.train.mixed_precision
    losses = []
    for batches in (held_out, [mismatched_images(b) for b in held_out]):
        total, count = evaluate_loss(model.model, batches, precision)
        losses.append(total / count)
    return CaptionLosses(losses[0], losses[1], seconds)


def main(argv: Sequence[str]) -> None:
    args = list(argv) or [DEFAULT_CONFIG]
    if args[0].startswith("--"):
        args = [DEFAULT_CONFIG, *args]
    args += ["--checkpoint.enabled=false"]
    reading = train_and_evaluate(args, mismatch_training=False)
    baseline = train_and_evaluate(args, mismatch_training=True)
    print(f"config: {' '.join(args)}")
    print(f"trained on matched images    : held-out caption loss {reading.matched:.4f}")
    print(f"  same model, mismatched     : held-out caption loss {reading.mismatched:.4f}")
    print(f"trained on mismatched images : held-out caption loss {baseline.matched:.4f}")
    print(f"matched / baseline ratio     : {reading.matched / baseline.matched:.3f}")
    print(f"training time                : {reading.seconds:.0f} s and {baseline.seconds:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
