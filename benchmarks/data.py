"""How fast the loader delivers tokens, against what debug training consumes; how long a resume
seeks.

Both measured in this run, on the prepared corpus (``make prepare-data``)::

    python benchmarks/data.py [--config configs/train/debug.toml] [--batches 2000]

Prints the training consumption (tokens/s of debug training steps), the loader's tokens/s in
several set-ups as a multiple of it (target >= 20x), and the time from ``load_state_dict`` to
the first batch at the start of an epoch and deep into a run.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch

from forge.config import DataSource, JobConfig, load_config
from forge.data.dataset import open_windows
from forge.data.loader import Batch, Sampling, TextLoader
from forge.data.mixture import resolve_phases
from forge.data.sampler import epoch_permutation
from forge.data.shards import read_manifest
from forge.model.transformer import Transformer
from forge.optim import build_optimizer, resolve_schedule
from forge.training.steps.spec import StepSpec
from forge.training.steps.text import make_text_step
from forge.types import LoopState


def training_tokens_per_s(config: JobConfig, steps: int) -> float:
    """Tokens/s the debug training step consumes (random tokens: the loader is not involved)."""
    torch.manual_seed(0)
    model = Transformer(config.model)
    opt = build_optimizer(model, config.optimizer)
    t = config.train
    schedule = resolve_schedule(config.scheduler, t.max_steps)
    spec = StepSpec(model, opt, schedule, config.optimizer.lr, t.mixed_precision, t.grad_clip_norm)
    step = make_text_step(spec)
    tokens = torch.randint(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1))
    group = tuple(Batch(tokens[:, :-1], tokens[:, 1:]) for _ in range(t.grad_accum_steps))
    step(group, LoopState())  # warm-up
    start = time.perf_counter()
    for i in range(steps):
        step(group, LoopState(step=i + 1))
    elapsed = time.perf_counter() - start
    return steps * t.batch_size * t.seq_len * t.grad_accum_steps / elapsed


def make_loader(config: JobConfig, sources: int, packed: bool, workers: int) -> TextLoader:
    folder = pathlib.Path(config.data.path)
    manifest = read_manifest(folder)
    windows = open_windows(folder, manifest, "train", config.train.seq_len, verify=False)
    named = [DataSource(f"s{i}", str(folder), weight=i + 1.0) for i in range(sources)]
    sampling = Sampling(
        sizes=(len(windows),) * sources,
        phases=resolve_phases(named, (), temperature=1.0),
        seed=0,
        batch_size=config.train.batch_size,
    )
    bos = int(manifest.tokenizer["bos_id"]) if packed else None
    return TextLoader([windows] * sources, sampling, bos_id=bos, num_workers=workers)


def loader_tokens_per_s(loader: TextLoader, batches: int) -> float:
    next(loader)  # workers started, first shard pages touched
    start = time.perf_counter()
    tokens = sum(next(loader).num_tokens for _ in range(batches))
    return tokens / (time.perf_counter() - start)


def seek_seconds(loader: TextLoader, state: dict) -> float:
    """Median time from ``load_state_dict`` to the first batch, over 5 seeks, each computing
    its epochs' permutations afresh (as a restarted process does)."""
    times = []
    for _ in range(5):
        epoch_permutation.cache_clear()
        start = time.perf_counter()
        loader.load_state_dict(state)
        next(loader)
        times.append(time.perf_counter() - start)
    return sorted(times)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--train-steps", type=int, default=6)
    args = parser.parse_args()
    config = load_config([args.config]).config
    consumed = training_tokens_per_s(config, args.train_steps)
    t = config.train
    print(
        f"debug training consumes {consumed:,.0f} tokens/s "
        f"(batch {t.batch_size} x {t.seq_len} x {t.grad_accum_steps} micro-batches)"
    )
    setups = [
        ("1 source", 1, False, 0),
        ("1 source, packed", 1, True, 0),
        ("3-source mixture", 3, False, 0),
        ("3-source mixture, packed, 2 workers", 3, True, 2),
    ]
    for name, sources, packed, workers in setups:
        rate = loader_tokens_per_s(make_loader(config, sources, packed, workers), args.batches)
        print(f"loader, {name:<36} {rate:>12,.0f} tokens/s = {rate / consumed:>6.0f}x training")
    for name, sources in (("1 source", 1), ("3-source mixture", 3)):
        loader = make_loader(config, sources, packed=False, workers=0)
        n = loader.sampling.sizes[0]
        start = {"micro_batch": 0, "cursors": [0] * sources}
        # a million micro-batches in: dozens of epochs of every source, mid-epoch
        deep_micro = 1_000_000
        rows = deep_micro * t.batch_size // sources
        deep = {"micro_batch": deep_micro, "cursors": [rows + n // 2 + i for i in range(sources)]}
        at_start, at_depth = seek_seconds(loader, start), seek_seconds(loader, deep)
        epochs = rows // n
        print(
            f"resume seek, {name:<17} start of run {at_start * 1e3:6.2f} ms | "
            f"micro-batch {deep_micro:,} (epoch {epochs}) {at_depth * 1e3:6.2f} ms | "
            f"ratio {at_depth / at_start:.2f}"
        )


if __name__ == "__main__":
    main()
