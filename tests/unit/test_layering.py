"""forge's floors: every module imports only from its own package or from a lower floor
(docs/architecture.md). Read from the source with ``ast``: nothing is imported here."""

from __future__ import annotations

import ast
import pathlib

import pytest

FORGE = pathlib.Path(__file__).resolve().parents[2] / "forge"

# package (or top-level module) -> floor; a module may import a lower floor or its own package
FLOORS = {
    "types": 0,  # the shared vocabulary: StepResult, LoopState, LoopOutcome, ExitCode, Hooks
    "errors": 0,
    "outputs": 0,  # the rules for output folders that scripts write
    "interrupts": 1,  # how a script ends at Ctrl-C or SIGTERM (reads ExitCode)
    "config": 1,
    "data": 2,
    "model": 3,
    "metrics": 3,
    "optim": 4,
    "parallel": 4,
    "checkpoint": 4,
    "resilience": 4,
    "harness": 4,  # lm-eval over a forge model (docs/evaluation.md)
    "training": 5,
}


def package_of(path: pathlib.Path) -> str:
    """``forge/<package>/...`` -> package; ``forge/<module>.py`` -> module."""
    return path.relative_to(FORGE).with_suffix("").parts[0]


def forge_imports(source: str) -> list[tuple[int, str]]:
    """(line, package) of every ``forge.<package>`` import in ``source``, wherever it stands
    (inside functions and ``TYPE_CHECKING`` blocks too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "forge" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def upward_imports(package: str, source: str) -> list[str]:
    """Every import in ``source`` (a module of ``package``) that reaches its own floor or a
    higher one in another package."""
    floor = FLOORS[package]
    return [
        f"line {line}: {package} (floor {floor}) imports forge.{target} "
        f"(floor {FLOORS.get(target, '?')})"
        for line, target in forge_imports(source)
        if target != package and FLOORS.get(target, floor) >= floor
    ]


def modules() -> list[pathlib.Path]:
    return sorted(p for p in FORGE.rglob("*.py") if p.name != "__init__.py" or p.parent != FORGE)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(FORGE)))
def test_no_module_imports_from_a_floor_above_its_own(path):
    assert upward_imports(package_of(path), path.read_text()) == []


def test_every_package_has_a_floor():
    assert {package_of(p) for p in modules()} == set(FLOORS)


@pytest.mark.parametrize(
    ("package", "source", "upward"),
    [
        ("optim", "from forge.training.plan import LoopPolicy", True),
        ("metrics", "import forge.training.hooks", True),
        ("resilience", "def f():\n    from forge.training import loop\n", True),
        ("parallel", "from forge.checkpoint.store import save", True),  # same floor, other package
        ("types", "from forge.config import JobConfig", True),
        ("optim", "from forge.types import FreezeTransition", False),
        ("training", "from forge.training.steps.spec import StepSpec", False),
        ("parallel", "from forge.metrics.flops import flops_per_token", False),
        ("model", "import torch\nfrom forge.data.packing import IGNORE_INDEX", False),
    ],
)
def test_the_rule_catches_an_upward_import(package, source, upward):
    assert bool(upward_imports(package, source)) is upward
