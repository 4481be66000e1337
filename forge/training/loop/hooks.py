"""Callbacks at fixed points of a run. Subclass ``Hooks`` and override what you need.

In one run they are called in this order: ``on_train_begin``; then for every step
``on_before_optimizer_step`` (gradients accumulated, global norm known, nothing clipped or
updated yet) and ``on_step_end`` (after the update and the step's effects: logging, saving);
``on_eval_end`` after an evaluation; ``on_checkpoint_save`` when a save commits (rank 0;
asynchronous saves commit later); ``on_train_end`` last. Hooks named in the config
(``[hooks]``) run after those a script passes to ``main``, in the order listed. ``Hooks``,
the base class, is defined in ``forge.types`` (metrics and resilience subclass it too) and
imported from here.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
from collections.abc import Sequence

import torch
from torch import nn

from forge.config.hooks import HooksConfig
from forge.config.loader import ConfigError
from forge.types import Hooks, LoopOutcome, LoopState, PendingStep, RemoteLocation, StepResult

__all__ = ["HookList", "Hooks", "configured_hooks", "hook_class", "hook_problems"]


class HookList(Hooks):
    """Calls each hook in order."""

    def __init__(self, hooks: Sequence[Hooks] = ()) -> None:
        self.hooks = list(hooks)

    def on_train_begin(self, state: LoopState) -> None:
        for h in self.hooks:
            h.on_train_begin(state)

    def on_before_optimizer_step(
        self, state: PendingStep, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        for h in self.hooks:
            h.on_before_optimizer_step(state, model, optimizer)

    def on_step_end(self, state: LoopState, result: StepResult) -> None:
        for h in self.hooks:
            h.on_step_end(state, result)

    def on_checkpoint_save(self, step: int, path: pathlib.Path | RemoteLocation) -> None:
        for h in self.hooks:
            h.on_checkpoint_save(step, path)

    def on_eval_end(self, state: LoopState, loss: float) -> None:
        for h in self.hooks:
            h.on_eval_end(state, loss)

    def on_train_end(self, outcome: LoopOutcome, state: LoopState) -> None:
        for h in self.hooks:
            h.on_train_end(outcome, state)


def hook_class(path: str) -> type:
    """The class ``"package.module:ClassName"`` names; ``ValueError`` saying what is wrong."""
    module_name, _, class_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import runs arbitrary code: report whatever it raised
        raise ValueError(f"cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"module {module_name!r} has no class {class_name!r}")
    if not issubclass(cls, Hooks):
        raise ValueError(f"{path} is not a subclass of forge.training.loop.hooks.Hooks")
    return cls


def hook_problems(cfg: HooksConfig) -> list[str]:
    """Every hook class that cannot be imported, or whose arguments its constructor does not
    take, as ``key: message`` lines (importing runs the modules; nothing is constructed)."""
    problems = []
    for i, path in enumerate(cfg.classes):
        try:
            cls = hook_class(path)
        except ValueError as exc:
            problems.append(f"hooks.classes[{i}]: {exc}")
            continue
        try:
            inspect.signature(cls).bind(**cfg.args.get(path, {}))
        except TypeError as exc:
            problems.append(f'hooks.args."{path}": {exc}')
    return problems


def configured_hooks(cfg: HooksConfig) -> list[Hooks]:
    """An instance of every ``[hooks]`` class, with its arguments, in the order listed;
    ``ConfigError`` if a constructor fails."""
    hooks = []
    for i, path in enumerate(cfg.classes):
        try:
            hooks.append(hook_class(path)(**cfg.args.get(path, {})))
        except Exception as exc:  # the user's constructor: report whatever it raised
            raise ConfigError(
                [f"hooks.classes[{i}]: {path} failed to construct ({type(exc).__name__}: {exc})"]
            ) from None
    return hooks
