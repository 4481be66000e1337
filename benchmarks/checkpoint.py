"""How long one save blocks the training loop, sync vs async, and how long a resume takes.

For the debug model and a ~100M-parameter model (fp32 weights + AdamW state), one process:
prints the sync save time, the time ``save()`` blocks in async mode (staging a copy) as a ratio
of the sync time, the time until the async write is committed, and the load time::

    python benchmarks/checkpoint.py [--skip-large]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import torch

from forge.checkpoint.checkpointer import Checkpointer
from forge.checkpoint.store import load_checkpoint, step_dir
from forge.config import ModelConfig, OptimizerConfig
from forge.config.sections import AsyncMode
from forge.model.transformer import Transformer, num_parameters
from forge.optim import build_optimizer

MODELS = {
    "debug": ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256),
    "100M": ModelConfig(dim=768, n_layers=12, n_heads=12, max_seq_len=256, vocab_size=32000),
}


def trained(cfg: ModelConfig) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = build_optimizer(model, OptimizerConfig())
    model(torch.randint(0, cfg.vocab_size, (1, 16))).float().mean().backward()
    opt.step()  # AdamW state exists, as in a real save
    opt.zero_grad()
    return model, opt


def measure(name: str, cfg: ModelConfig, root: pathlib.Path) -> None:
    model, opt = trained(cfg)
    sync = Checkpointer(root / "sync", AsyncMode.DISABLED, 0, 1)
    start = time.perf_counter()
    sync.save(1, model, opt, {"step": 1})
    sync_s = time.perf_counter() - start
    background = Checkpointer(root / "async", AsyncMode.ASYNC, 0, 1)
    start = time.perf_counter()
    background.save(1, model, opt, {"step": 1})
    blocked_s = time.perf_counter() - start
    background.wait()
    committed_s = time.perf_counter() - start
    fresh, fresh_opt = trained(cfg)
    start = time.perf_counter()
    load_checkpoint(step_dir(root / "sync", 1), fresh, fresh_opt)
    load_s = time.perf_counter() - start
    print(
        f"{name:>6} ({num_parameters(model) / 1e6:.1f}M params): sync save {sync_s:.3f} s | "
        f"async blocks {blocked_s:.3f} s (ratio {blocked_s / sync_s:.2f}), committed after "
        f"{committed_s:.3f} s | resume load {load_s:.3f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in MODELS.items():
            if name == "100M" and args.skip_large:
                continue
            measure(name, cfg, pathlib.Path(tmp) / name)


if __name__ == "__main__":
    main()
