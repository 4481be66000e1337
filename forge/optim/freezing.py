"""The freeze schedule applied to a model and its optimizer (``[[freeze]]``, see
``forge.config.freeze`` for the rules): a dynamic optimizer whose parameter set follows it.

A frozen parameter has ``requires_grad = False``, so it gets no gradient (FSDP2 reduces none
for it) and the optimizer holds no state for it. When a stage ends, the newly trainable
parameters join the optimizer as new parameter groups, split by weight decay like the
first ones, with fresh state. Every rank applies the schedule at the start of the same step
(a pure function of the step), so they agree without a collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from forge.config.freeze import FreezeRule, trainable_names, transition_steps
from forge.config.sections import OptimizerConfig
from forge.model.transformer import canonical_name
from forge.optim.param_groups import groups_of
from forge.types import FreezeTransition


class Freezer:
    """Holds ``model`` and ``optimizer`` to the schedule ``rules``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rules: Sequence[FreezeRule],
        cfg: OptimizerConfig,
        holds_step: int = 1,
    ) -> None:
        """``optimizer`` was built over the parameters that train in ``holds_step``
        (``freeze_for_step`` before ``build_optimizer``)."""
        self.optimizer = optimizer
        self.rules = tuple(rules)
        self.cfg = cfg
        self.params = named_parameters(model)
        self.current: frozenset[str] | None = self.trainable_at(holds_step)
        self.transitions = frozenset(transition_steps(self.rules))
        self.settled = True  # the current set is the schedule's: only transitions change it

    def trainable_at(self, step: int) -> frozenset[str]:
        """The parameters (of this model or pipeline stage) that train in ``step``."""
        return trainable_names(self.params, self.rules, step)

    def apply(self, step: int) -> FreezeTransition | None:
        """Make the model and optimizer train exactly ``step``'s set; the transition if it
        changed (``hold``). Cheap on every other step: the set can change only at a
        transition step, or after ``hold`` put in another schedule's set."""
        if self.settled and step not in self.transitions:
            return None
        transition = self.hold(self.trainable_at(step), step)
        self.settled = True
        return transition

    def hold(self, want: frozenset[str], step: int) -> FreezeTransition | None:
        """Make the model and optimizer train exactly the parameters ``want``; the
        transition, reported at ``step``, if that changed anything. New parameters join the
        optimizer with fresh state; a set that is not a superset of the current one (an older
        checkpoint's) rebuilds the groups from scratch."""
        want = want & self.params.keys()
        self.settled = False  # until ``apply`` checks the schedule's own set again
        if want == self.current:
            return None
        self._mark(want)
        named = [(n, p) for n, p in self.params.items() if n in want]
        if self.current is None or not self.current <= want:
            self.optimizer.param_groups.clear()
            self.optimizer.state.clear()
        else:
            named = [(n, p) for n, p in named if n not in self.current]
        defaults = {k: v for k, v in self.optimizer.defaults.items() if k != "params"}
        for group in groups_of(named, self.cfg):
            del group["names"]
            self.optimizer.add_param_group(defaults | group)
        self.current = want
        return self.counts(step)

    def counts(self, step: int) -> FreezeTransition:
        """How many parameter elements train now (reported at ``step``), how many are
        frozen."""
        want = self.current if self.current is not None else self.trainable_at(step)
        trainable = sum(p.numel() for n, p in self.params.items() if n in want)
        total = sum(p.numel() for p in self.params.values())
        return FreezeTransition(step, trainable, total - trainable)

    def _mark(self, trainable: frozenset[str]) -> None:
        mark_trainable(self.params, trainable)


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's parameters by checkpoint name, tied weights once (under their first)."""
    unique = {id(p): (canonical_name(n), p) for n, p in model.named_parameters()}
    return dict(unique.values())


def mark_trainable(params: dict[str, nn.Parameter], trainable: frozenset[str]) -> None:
    """``requires_grad`` on exactly the parameters named in ``trainable``."""
    for name, p in params.items():
        p.requires_grad_(name in trainable)


def freeze_for_step(model: nn.Module, rules: Sequence[FreezeRule], step: int) -> None:
    """Before the optimizer is built: freeze what the schedule freezes in ``step``."""
    params = named_parameters(model)
    mark_trainable(params, trainable_names(params, rules, step))
