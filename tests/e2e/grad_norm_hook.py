"""Hooks a test config names in ``[hooks]`` (imported by path, like a user's own)."""

from __future__ import annotations

import json
import pathlib

import torch

from forge.model.transformer import canonical_name
from forge.training.loop.hooks import Hooks


class LayerGradNorms(Hooks):
    """Appends each step's gradient norm per top-level layer to ``path`` (JSONL)."""

    def __init__(self, path: str, every: int = 1) -> None:
        self.path = pathlib.Path(path)
        self.every = every

    def on_before_optimizer_step(self, state, model, optimizer) -> None:
        if state.step % self.every:
            return
        squares: dict[str, float] = {}
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            parts = canonical_name(name).split(".")
            layer = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
            squares[layer] = squares.get(layer, 0.0) + float(p.grad.float().square().sum())
        record = {"step": state.step, "grad_norm": state.result.grad_norm}
        record["layers"] = {k: v**0.5 for k, v in squares.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class Exploding(Hooks):
    def __init__(self) -> None:
        raise RuntimeError("no GPU here")


class NotAHook:
    pass


_ = torch  # the hook module imports what a user's would
