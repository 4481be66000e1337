"""Step time of bf16 autocast vs fp32 on this machine, for the debug model.

Whether bf16 pays off on a CPU depends on the instruction set (AVX-512 BF16 or AMX: yes;
AVX2 only: bf16 matmuls are emulated). Prints both and their ratio::

    python benchmarks/precision.py [--steps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from forge.config import ModelConfig
from forge.model.transformer import Transformer


def step_time(model: Transformer, tokens: torch.Tensor, bf16: bool, steps: int) -> float:
    """Median seconds of forward + backward."""
    times = []
    for _ in range(steps + 1):  # the first is a warm-up
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        start = time.perf_counter()
        with ctx:
            logits = model(tokens)
        logits.float().mean().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256))
    tokens = torch.randint(0, 259, (8, 256))
    fp32 = step_time(model, tokens, False, args.steps)
    bf16 = step_time(model, tokens, True, args.steps)
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}")
    print(f"fp32 forward+backward: {fp32:.3f} s; bf16 autocast: {bf16:.3f} s")
    print(f"ratio bf16 / fp32 step time: {bf16 / fp32:.2f}")


if __name__ == "__main__":
    main()
