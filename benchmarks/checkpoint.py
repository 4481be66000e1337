"""How long one save blocks the training loop, sync vs async, and how long a resume takes.

For the debug model and a ~100M-parameter model (fp32 weights + AdamW state), one process:
prints the sync save time; for each async mode, the time ``save()`` blocks the loop (staging a
copy) as a ratio of the sync time, for the first save (staging buffers allocated, checkpoint
process started) and for a later one (buffers reused), and the time until that save is
committed; the share of the sync save spent on the integrity work it now includes (the
checksums of every file written, the finiteness check of the weights; target: at most 5%),
the time a resume spends verifying the checksums; and the resume load time::

    python benchmarks/checkpoint.py [--skip-large]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import torch

from forge.checkpoint.checkpointer import Checkpointer, nonfinite_parameter
from forge.checkpoint.integrity import checksums_of, verify_checkpoint
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
    lines = []
    for mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_PROCESS):
        background = Checkpointer(root / mode.value, mode, 0, 1)
        blocked = []
        for step in (1, 2):
            start = time.perf_counter()
            background.save(step, model, opt, {"step": step})
            blocked.append(time.perf_counter() - start)
            background.wait()
            committed_s = time.perf_counter() - start
        background.close()
        lines.append(
            f"  {mode.value:>13}: first save blocks {blocked[0]:.3f} s "
            f"(ratio {blocked[0] / sync_s:.3f}), later saves {blocked[1]:.3f} s "
            f"(ratio {blocked[1] / sync_s:.3f}), committed after {committed_s:.3f} s"
        )
    saved = step_dir(root / "sync", 1)
    files = [p.name for p in saved.iterdir() if p.is_file()]
    start = time.perf_counter()
    checksums_of(saved, files)  # what the commit computes, the files fresh in the page cache
    checksum_s = time.perf_counter() - start
    start = time.perf_counter()
    nonfinite_parameter(model)
    finite_s = time.perf_counter() - start
    start = time.perf_counter()
    verify_checkpoint(saved)
    verify_s = time.perf_counter() - start
    fresh, fresh_opt = trained(cfg)
    start = time.perf_counter()
    load_checkpoint(saved, fresh, fresh_opt)  # verifies the checksums too
    load_s = time.perf_counter() - start
    size_mb = sum((saved / f).stat().st_size for f in files) / 1e6
    print(
        f"{name} ({num_parameters(model) / 1e6:.1f}M params, {size_mb:.0f} MB): sync save "
        f"{sync_s:.3f} s, of which checksums {checksum_s:.4f} s (ratio {checksum_s / sync_s:.3f}) "
        f"and the finiteness check {finite_s:.4f} s (ratio {finite_s / sync_s:.3f}); resume "
        f"load {load_s:.3f} s, of which verifying {verify_s:.4f} s "
        f"(ratio {verify_s / load_s:.3f})"
    )
    print("\n".join(lines))


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
