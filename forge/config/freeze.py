"""``[[freeze]]``: which parameters train at which step. Pure: the schedule is a function of
the step, table-tested in ``tests/unit/test_freeze.py``.

Each entry names a module (``"tok_embeddings"``, ``"layers.0"``) or an fnmatch pattern over
parameter names (``"layers.*.attention.*"``); it covers the module's parameters and everything
under it. ``frozen = true`` (the default) freezes them for optimizer steps ``1 ..
until_step`` (every step when ``until_step`` is left out); ``frozen = false`` keeps them
trainable over an earlier entry. For a parameter at a step, the last entry in force that
covers it decides; none: it trains. Unfreezing is one-way: a parameter that has trained is
never frozen again (its optimizer state would go stale).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

import attrs

from forge.config.ranges import Problem


@attrs.frozen
class FreezeRule:
    """One ``[[freeze]]`` entry."""

    module: str
    frozen: bool = True
    until_step: int | None = None  # the last step it is in force (None: every step)

    def problems(self, key: str) -> list[Problem]:
        p: list[Problem] = []
        if not self.module.strip():
            p.append((f"{key}.module", "must name a module or a pattern of parameter names"))
        if self.until_step is not None and self.until_step < 1:
            p.append((f"{key}.until_step", f"must be >= 1, got {self.until_step}"))
        return p


def covers(rule: FreezeRule, name: str) -> bool:
    """Whether ``rule`` covers parameter ``name``: its module itself or anything under it."""
    return fnmatch.fnmatchcase(name, rule.module) or fnmatch.fnmatchcase(name, rule.module + ".*")


def is_frozen(name: str, rules: Sequence[FreezeRule], step: int) -> bool:
    """Whether parameter ``name`` is frozen in optimizer step ``step`` (1-based): the last
    rule in force at ``step`` that covers it decides; trainable when none does."""
    frozen = False
    for rule in rules:
        in_force = rule.until_step is None or step <= rule.until_step
        if in_force and covers(rule, name):
            frozen = rule.frozen
    return frozen


def trainable_names(names: Iterable[str], rules: Sequence[FreezeRule], step: int) -> frozenset[str]:
    """The parameters that train in step ``step``."""
    return frozenset(n for n in names if not is_frozen(n, rules, step))


def transition_steps(rules: Sequence[FreezeRule]) -> tuple[int, ...]:
    """The steps at which the trainable set may change: the step after each ``until_step``."""
    return tuple(sorted({r.until_step + 1 for r in rules if r.until_step is not None}))


def schedule_problems(names: Sequence[str], rules: Sequence[FreezeRule]) -> list[str]:
    """What the schedule cannot do to a model with parameters ``names``: an entry that covers
    no parameter, nothing to train at step 1, a parameter frozen again after it trained."""
    problems: list[str] = []
    for i, rule in enumerate(rules):
        if not any(covers(rule, n) for n in names):
            problems.append(
                f"freeze[{i}].module: {rule.module!r} covers no parameter of the model "
                f"(names look like {names[0]!r})"
            )
    if rules and not trainable_names(names, rules, 1):
        problems.append("freeze: every parameter is frozen at step 1; nothing would train")
    trained: set[str] = set(trainable_names(names, rules, 1))
    for step in transition_steps(rules):
        now = trainable_names(names, rules, step)
        refrozen = sorted(trained - now)
        if refrozen:
            problems.append(
                f"freeze: {refrozen[0]!r} trains before step {step} and is frozen again from "
                "it; unfreezing is one-way (its optimizer state would go stale)"
            )
            break
        trained |= now
    return problems
