"""Latent attention (``[model.mla]``) against grouped-query attention at (nearly) equal
parameters: the step time of the whole debug-shaped model, its parameters, and the KV cache a
token costs.

The debug model (dim 256, 4 layers, 4 heads of 64, 2 KV heads, seq 256, batch 8) against the
same model whose attention is latent: ``kv_rank`` 128, ``q_rank`` 0, ``nope_dim`` 48,
``rope_dim`` 16, ``v_dim`` 64 (its attention has a few percent more parameters). Forward +
backward of one batch, both alternating within each round, medians of ``--rounds`` rounds of
``--steps`` steps; the KV cache counted from ``KVCache`` itself. Then the KV cache at
DeepSeek-V3's shapes (``configs/train/deepseek_v3_671b.toml``: the latent, 512 + 64 a token and
layer) against the same model with grouped-query attention of 128-wide heads (128, 8 and 1 KV
heads), in bf16, again from ``KVCache``::

    python benchmarks/latent_attention.py [--rounds 5] [--steps 5] [--dtype fp32|bf16] [--threads N]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import attrs
import torch

from forge.cli import summary
from forge.config import load_config
from forge.config.latent import LatentConfig
from forge.config.sections import ModelConfig
from forge.metrics.flops import flops_per_token
from forge.model.transformer import KVCache, Transformer, num_parameters
from forge.training.setup.problems import cpu_flags

GQA = ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=259, max_seq_len=256)
MLA = attrs.evolve(GQA, mla=LatentConfig(kv_rank=128, q_rank=0, nope_dim=48, rope_dim=16, v_dim=64))


def seconds_per_step(
    model: Transformer, tokens: torch.Tensor, steps: int, dtype
) -> tuple[float, float]:
    """(wall, CPU) seconds a step. The process's CPU time is the steadier figure on a machine
    other jobs share: it does not count the time the scheduler gives them (with ``--threads 1``
    no idle thread spins in it either)."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), tokens[:, 1:])
        loss.backward()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def cache_values(cfg: ModelConfig) -> int:
    """Values one token adds to the KV cache, all layers."""
    cache = KVCache(attrs.evolve(cfg, max_seq_len=1))
    return cache.keys.numel() + cache.values.numel()


def cache_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one token adds to the KV cache, all layers, in ``dtype``: ``KVCache``'s own."""
    cache = KVCache(attrs.evolve(cfg, max_seq_len=1), dtype=dtype)
    return sum(t.numel() * t.element_size() for t in (cache.keys, cache.values))


def deepseek_v3_cache() -> None:
    """The KV cache a token costs at DeepSeek-V3's shapes, latent against grouped-query
    attention of 128-wide heads in the same model (bf16, as the release serves it)."""
    preset = pathlib.Path(__file__).parent.parent / "configs/train/deepseek_v3_671b.toml"
    v3 = load_config([str(preset)]).config.model
    assert v3.mla is not None
    layers, mla = v3.n_layers, cache_bytes(v3, torch.bfloat16)
    print(f"DeepSeek-V3 ({preset.name}): {layers} layers, {v3.n_heads} heads, bf16 KV cache")
    header = f"{'values/layer':>12s} {'bytes/layer':>11s} {'KiB/token':>9s}  vs mla"
    print(f"  {'attention':34s} {header}")
    rows = [(f"mla (kv_rank {v3.mla.kv_rank} + rope {v3.mla.rope_dim})", v3)]
    for kv in (v3.n_heads, 8, 1):
        gqa = attrs.evolve(v3, mla=None, n_kv_heads=kv, head_dim=128)
        rows.append((f"gqa {kv} kv heads x 128", gqa))
    for name, cfg in rows:
        total = cache_bytes(cfg, torch.bfloat16)
        per_layer = total // layers
        print(f"  {name:34s} {per_layer // 2:12,d} {per_layer:11,d} {total / 1024:9.1f}  "
              f"{total / mla:5.1f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    models = {"gqa": Transformer(GQA), "mla": Transformer(MLA)}
    tokens = torch.randint(0, 259, (8, 257))
    for model in models.values():
        seconds_per_step(model, tokens, 1, dtype)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    for r in range(args.rounds):
        for name in list(models)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(seconds_per_step(models[name], tokens, args.steps, dtype))
    flags = cpu_flags()
    print(f"cpu flags: avx512_bf16={'avx512_bf16' in flags} amx={'amx_bf16' in flags}; "
          f"{torch.get_num_threads()} threads, {args.dtype}")  # fmt: skip
    for name, cfg in (("gqa", GQA), ("mla", MLA)):
        wall, cpu = ([x[i] for x in times[name]] for i in (0, 1))
        print(
            f"{name}: {num_parameters(models[name]) / 1e6:.3f}M parameters, "
            f"KV cache {cache_values(cfg)} values = {cache_bytes(cfg, dtype)} bytes a token\n"
            f"  wall {statistics.median(wall) * 1e3:7.1f} ms a step (rounds: "
            f"{', '.join(f'{x * 1e3:.0f}' for x in wall)})\n"
            f"  cpu  {statistics.median(cpu) * 1e3:7.1f} ms a step (rounds: "
            f"{', '.join(f'{x * 1e3:.0f}' for x in cpu)})"
        )
    for i, kind in enumerate(("wall", "cpu")):
        ratio = statistics.median(x[i] for x in times["mla"]) / statistics.median(
            x[i] for x in times["gqa"]
        )
        pairs = zip(times["mla"], times["gqa"], strict=True)
        paired = statistics.median(m[i] / g[i] for m, g in pairs)
        print(f"step time mla / gqa, {kind}: {ratio:.2f} (the rounds' own, median: {paired:.2f})")
    flops = flops_per_token(MLA, tokens.shape[1] - 1) / flops_per_token(GQA, tokens.shape[1] - 1)
    print(f"FLOPs a token mla / gqa (forge.metrics.flops): {flops:.3f}")
    print(f"KV cache mla / gqa: {cache_values(MLA) / cache_values(GQA):.2f}")
    deepseek_v3_cache()


if __name__ == "__main__":
    main()
