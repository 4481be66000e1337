"""``--section.key=value`` command-line overrides: split from other arguments, parsed as TOML
values, applied over the file's nested tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tomli


def parse_override_value(text: str) -> Any:
    """A CLI value in TOML syntax (``[0.9,0.95]``, ``true``, ``3e-4``); bare words stay strings."""
    try:
        return tomli.loads(f"v = {text}")["v"]
    except tomli.TOMLDecodeError:
        return text


def parse_cli(argv: Sequence[str]) -> tuple[list[tuple[str, Any]], list[str]]:
    """Split ``--a.b=value`` overrides from everything else; returns (overrides, problems)."""
    overrides: list[tuple[str, Any]] = []
    problems: list[str] = []
    for arg in argv:
        if not arg.startswith("--"):
            problems.append(
                f"{arg!r}: unexpected argument; overrides look like --section.key=value"
            )
            continue
        key, sep, value = arg[2:].partition("=")
        if not key or "." not in key:
            problems.append(f"{arg!r}: overrides look like --section.key=value")
            continue
        overrides.append((key, parse_override_value(value) if sep else True))
    return overrides, problems


def apply_overrides(raw: dict[str, Any], overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """A copy of ``raw`` with each dotted key set; intermediate tables are created."""
    out = _deep_copy(raw)
    for key, value in overrides:
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[leaf] = value
    return out


def _deep_copy(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
