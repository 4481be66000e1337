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
    "jsonl": 0,  # the rule for the JSON-lines records a run appends to
    "console": 0,  # a script's console that goes away
    "cache": 0,  # forge's cache folder and its files (the CPU peak, lm-eval's task names)
    "interrupts": 1,  # how a script ends at Ctrl-C or SIGTERM (reads ExitCode)
    "cli": 1,  # the scripts' shared command-line options (--device, --dtype)
    "config": 1,
    "data": 2,
    "model": 3,
    "metrics": 3,
    "optim": 4,
    "parallel": 4,
    "checkpoint": 4,
    "interop": 4,  # Hugging Face families, export and import (docs/interop.md)
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
        ("optim", "from forge.training.loop.plan import LoopPolicy", True),
        ("metrics", "import forge.training.loop.hooks", True),
        ("resilience", "def f():\n    from forge.training.loop import loop\n", True),
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


# ---- no circle inside a package (lazy imports in functions count) ----


def module_name(path: pathlib.Path) -> str:
    """``forge/data/loader.py`` -> ``forge.data.loader``; a package's ``__init__`` is the package."""
    parts = path.relative_to(FORGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(source: str, known: set[str]) -> set[str]:
    """The forge modules of ``known`` that ``source`` imports, wherever the import stands:
    ``from forge.a import b`` is ``forge.a.b`` when that is a module, else ``forge.a``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & known


def circles(sources: dict[str, str]) -> list[list[str]]:
    """The import circles among ``sources`` (module name -> source) whose modules share a
    package (``forge.<package>``): each strongly connected group of two or more, or a module
    that imports itself (Tarjan's algorithm)."""
    known = set(sources)
    package = {m: m.split(".")[1] for m in known}
    edges = {
        m: sorted(t for t in module_imports(src, known) if package[t] == package[m])
        for m, src in sources.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in edges[m]:
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            group = []
            while True:
                t = stack.pop()
                group.append(t)
                if t == m:
                    break
            if len(group) > 1 or m in edges[m]:
                found.append(sorted(group))

    for m in sorted(known):
        if m not in index:
            visit(m)
    return found


def test_no_package_has_an_import_circle_inside_it():
    sources = {module_name(p): p.read_text() for p in modules()}
    assert circles(sources) == []


@pytest.mark.parametrize(
    ("sources", "circle"),
    [
        ({"forge.data.a": "from forge.data.b import x", "forge.data.b": "def f():\n    from forge.data import a\n"},
         [["forge.data.a", "forge.data.b"]]),  # a lazy import closes it
        ({"forge.data.a": "import forge.data.b", "forge.data.b": "import forge.data.c", "forge.data.c": "from forge.data.a import y"},
         [["forge.data.a", "forge.data.b", "forge.data.c"]]),
        ({"forge.data.a": "from forge.data.a import z"}, [["forge.data.a"]]),
        ({"forge.data.a": "from forge.data.b import x", "forge.data.b": "from forge.types import T"}, []),
        ({"forge.data.a": "from forge.model.m import x", "forge.model.m": "from forge.data.a import y"}, []),  # across packages: the floors' rule
    ],
    ids=["a lazy circle", "three modules", "a module importing itself", "no circle", "across packages"],
)  # fmt: skip
def test_the_circle_rule_catches_a_circle(sources, circle):
    assert circles(sources) == circle
