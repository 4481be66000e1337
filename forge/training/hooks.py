"""Callbacks at fixed points of a run. Subclass ``Hooks`` and override what you need."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from forge.training.outcome import LoopOutcome
from forge.training.state import LoopState, StepResult


class Hooks:
    """No-op base: every method is optional."""

    def on_train_begin(self, state: LoopState) -> None:
        """Before the first step (also on resume)."""

    def on_step_end(self, state: LoopState, result: StepResult) -> None:
        """After every step and its effects."""

    def on_checkpoint_save(self, step: int, path: pathlib.Path) -> None:
        """On rank 0, after a checkpoint is committed (``latest`` points at it)."""

    def on_eval_end(self, state: LoopState, loss: float) -> None:
        """On every rank, after an evaluation; ``loss`` is the mean over data-parallel ranks."""

    def on_train_end(self, outcome: LoopOutcome, state: LoopState) -> None:
        """After the final save and the wait."""


class HookList(Hooks):
    """Calls each hook in order."""

    def __init__(self, hooks: Sequence[Hooks] = ()) -> None:
        self.hooks = list(hooks)

    def on_train_begin(self, state: LoopState) -> None:
        for h in self.hooks:
            h.on_train_begin(state)

    def on_step_end(self, state: LoopState, result: StepResult) -> None:
        for h in self.hooks:
            h.on_step_end(state, result)

    def on_checkpoint_save(self, step: int, path: pathlib.Path) -> None:
        for h in self.hooks:
            h.on_checkpoint_save(step, path)

    def on_eval_end(self, state: LoopState, loss: float) -> None:
        for h in self.hooks:
            h.on_eval_end(state, loss)

    def on_train_end(self, outcome: LoopOutcome, state: LoopState) -> None:
        for h in self.hooks:
            h.on_train_end(outcome, state)
