"""Generation speed with the KV cache against recomputing the whole context per token.

The debug model (random weights: speed does not depend on them), greedy, one sequence;
prints tokens/s of each and their ratio::

    python benchmarks/generation.py [--new-tokens 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from forge.cli import summary
from forge.config import load_config
from forge.model.generate import sample
from forge.model.transformer import Transformer


def tokens_per_s(model: Transformer, new_tokens: int, use_cache: bool) -> float:
    start = time.perf_counter()
    out = sample(model, [1, 2, 3, 4], new_tokens, temperature=0, use_cache=use_cache)
    assert len(out) == 4 + new_tokens
    return new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = load_config([args.config]).config.model
    model = Transformer(cfg).eval()
    tokens_per_s(model, 8, True)  # warm-up
    cached, uncached = [], []
    for r in range(args.rounds):  # alternate which goes first
        pair = [(cached, True), (uncached, False)]
        for rates, use_cache in pair if r % 2 == 0 else pair[::-1]:
            rates.append(tokens_per_s(model, args.new_tokens, use_cache))
    c, u = statistics.median(cached), statistics.median(uncached)
    print(f"model: {cfg.dim}d x {cfg.n_layers} layers, {args.new_tokens} new tokens, greedy, fp32")
    print(f"cached:   {c:8,.0f} tokens/s (rounds: {', '.join(f'{x:,.0f}' for x in cached)})")
    print(f"uncached: {u:8,.0f} tokens/s (rounds: {', '.join(f'{x:,.0f}' for x in uncached)})")
    print(f"ratio cached / uncached: {c / u:.2f}")


if __name__ == "__main__":
    main()
