"""forge's training throughput as a ratio of a minimal hand-written PyTorch loop.

Both loops train the same model (the debug config's) on the same batches from the same loader,
with the same optimizer, schedule and clipping; rounds alternate A/B so that machine noise
hits both. Prints tokens/s for each and their ratio (target >= 0.97)::

    python benchmarks/loop_overhead.py [--steps 30] [--rounds 3] [--config configs/train/debug.toml]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import tempfile
import time

import attrs
import torch
import torch.nn.functional as F

from forge.cli import summary
from forge.config import load_config
from forge.data.dataset import TokenWindows
from forge.data.loader import TextLoader, single_source, step_batches
from forge.data.shards import open_split, read_manifest
from forge.model.chunked_loss import loss_spec_of
from forge.model.transformer import Transformer
from forge.optim import build_optimizer, lr_at, resolve_schedule
from forge.training.context import DataContext, DistContext, ModelContext, RunContext
from forge.training.loop.effects import TrainingEffects
from forge.training.loop.loop import run_training_loop
from forge.training.loop.plan import loop_policy
from forge.training.steps.select import make_step_fn
from forge.types import LoopOutcome, LoopState


def fresh(config, seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(config.model)
    return model, build_optimizer(model, config.optimizer)


def loader(config) -> TextLoader:
    folder = pathlib.Path(config.data.path)
    manifest = read_manifest(folder)
    windows = TokenWindows(open_split(folder, manifest, "train", False), config.train.seq_len)
    seed = config.train.effective_data_seed
    sampling = single_source(len(windows), config.train.batch_size, seed)
    return TextLoader([windows], sampling)


def hand_written(config, steps: int) -> float:
    """The baseline: the loop anyone would write by hand. Returns tokens/s."""
    model, opt = fresh(config)
    schedule = resolve_schedule(config.scheduler, config.train.max_steps)
    batches = loader(config)
    clip = config.train.grad_clip_norm or math.inf
    start = time.perf_counter()
    tokens = 0
    accum = config.train.grad_accum_steps
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(schedule, config.optimizer.lr, step)
        for _ in range(accum):
            batch = next(batches)
            logits = model(batch.inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten())
            (loss / accum).backward()
            tokens += batch.num_tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % config.metrics.log_interval == 0:
            print(f"baseline step {step + 1} | loss {loss.item():.4f}")
    return tokens / (time.perf_counter() - start)


def with_forge(config, steps: int, workdir: pathlib.Path) -> float:
    """The same training through forge's loop, step function and effects. Returns tokens/s."""
    model, opt = fresh(config)
    run = RunContext(config, pathlib.Path("bench"), workdir, workdir / "checkpoints")
    dist = DistContext()
    schedule = resolve_schedule(config.scheduler, config.train.max_steps)
    mctx = ModelContext(model, opt, schedule, 0, loss=loss_spec_of(config))
    manifest = read_manifest(pathlib.Path(config.data.path))
    data = DataContext(manifest, loader(config), None)
    policy = attrs.evolve(loop_policy(config), max_steps=steps, schedule=None, eval_interval=0)
    effects = TrainingEffects(run, dist, mctx, data)
    start = time.perf_counter()
    effects.begin(LoopState())
    _, state = run_training_loop(
        LoopState(),
        step_batches(data.train_loader, config.train.grad_accum_steps),
        make_step_fn(run, dist, mctx),
        policy,
        effects,
    )
    elapsed = time.perf_counter() - start
    effects.end(LoopOutcome.COMPLETED, state)
    return state.tokens_seen / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = load_config([args.config, "--metrics.jsonl=true"]).config
    base, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        hand_written(config, 3)  # warm-up: allocator, thread pool, page cache
        for r in range(args.rounds):  # ABBA order: neither loop always runs first
            if r % 2 == 0:
                base.append(hand_written(config, args.steps))
                ours.append(with_forge(config, args.steps, pathlib.Path(tmp) / f"r{r}"))
            else:
                ours.append(with_forge(config, args.steps, pathlib.Path(tmp) / f"r{r}"))
                base.append(hand_written(config, args.steps))
    b, f = statistics.median(base), statistics.median(ours)
    print()
    t = config.train
    print(
        f"model: {config.model.dim}d x {config.model.n_layers} layers, batch {t.batch_size} x "
        f"{t.seq_len} x {t.grad_accum_steps} micro-batches, {t.mixed_precision.value}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"hand-written loop: {b:,.0f} tokens/s (rounds: {', '.join(f'{x:,.0f}' for x in base)})")
    print(f"forge loop:        {f:,.0f} tokens/s (rounds: {', '.join(f'{x:,.0f}' for x in ours)})")
    print(f"ratio forge / hand-written: {f / b:.3f}")


if __name__ == "__main__":
    main()
