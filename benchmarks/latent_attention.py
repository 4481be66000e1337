"""Latent attention (``[model.mla]``) against grouped-query attention at (nearly) equal
parameters: the step time of the whole debug-shaped model, its parameters, and the KV cache a
token costs.

The debug model (dim 256, 4 layers, 4 heads of 64, 2 KV heads, seq 256, batch 8) against the
same model whose attention is latent: ``kv_rank`` 128, ``q_rank`` 0, ``nope_dim`` 48,
``rope_dim`` 16, ``v_dim`` 64 (its attention has a few percent more parameters). Forward +
backward of one batch, both alternating within each round, medians of ``--rounds`` rounds of
``--steps`` steps; the KV cache counted from ``KVCache`` itself::

    python benchmarks/latent_attention.py [--rounds 5] [--steps 5] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import attrs
import torch

from forge.cli import summary
from forge.config.latent import LatentConfig
from forge.config.sections import ModelConfig
from forge.model.transformer import KVCache, Transformer, num_parameters
from forge.training.setup.problems import cpu_flags

GQA = ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=259, max_seq_len=256)
MLA = attrs.evolve(GQA, mla=LatentConfig(kv_rank=128, q_rank=0, nope_dim=48, rope_dim=16, v_dim=64))


def seconds_per_step(model: Transformer, tokens: torch.Tensor, steps: int, dtype) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), tokens[:, 1:])
        loss.backward()
    return (time.perf_counter() - start) / steps


def cache_values(cfg: ModelConfig) -> int:
    """Values one token adds to the KV cache, all layers."""
    cache = KVCache(attrs.evolve(cfg, max_seq_len=1))
    return cache.keys.numel() + cache.values.numel()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    models = {"gqa": Transformer(GQA), "mla": Transformer(MLA)}
    tokens = torch.randint(0, 259, (8, 257))
    for model in models.values():
        seconds_per_step(model, tokens, 1, dtype)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        for name in list(models)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(seconds_per_step(models[name], tokens, args.steps, dtype))
    flags = cpu_flags()
    print(f"cpu flags: avx512_bf16={'avx512_bf16' in flags} amx={'amx_bf16' in flags}; "
          f"{torch.get_num_threads()} threads, {args.dtype}")  # fmt: skip
    for name, cfg in (("gqa", GQA), ("mla", MLA)):
        t = statistics.median(times[name])
        rounds = ", ".join(f"{x * 1e3:.0f}" for x in times[name])
        print(
            f"{name}: {num_parameters(models[name]) / 1e6:.3f}M parameters, "
            f"{t * 1e3:7.1f} ms a step (rounds: {rounds}), "
            f"KV cache {cache_values(cfg)} values a token"
        )
    ratio = statistics.median(times["mla"]) / statistics.median(times["gqa"])
    print(f"step time mla / gqa: {ratio:.2f}")
    print(f"KV cache mla / gqa: {cache_values(MLA) / cache_values(GQA):.2f}")


if __name__ == "__main__":
    main()
