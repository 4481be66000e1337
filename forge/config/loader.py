"""Load a ``JobConfig``: defaults → TOML file → ``--section.key=value`` overrides → validation.

Every problem is collected and raised together as one ``ConfigError`` whose lines each name the
dotted key and the fix. Nothing here touches the disk except reading the TOML file.
"""

from __future__ import annotations

import difflib
import enum
import pathlib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import cattrs
import tomli
from cattrs.errors import ClassValidationError, IterableValidationError

from forge.config.sections import JobConfig, Problem
from forge.config.validate import cross_section_problems
from forge.errors import UserInputError


class ConfigError(UserInputError):
    """One or more config problems; ``lines`` holds one message per problem."""


@attrs.frozen
class LoadedConfig:
    """A validated config and where it came from."""

    config: JobConfig
    source: pathlib.Path
    overrides: tuple[str, ...]


def _reject_bool(value: Any, expected: str) -> None:
    if isinstance(value, bool):
        raise TypeError(f"expected {expected}, got a boolean")


def _structure_int(value: Any, _: type) -> int:
    _reject_bool(value, "an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise TypeError(f"expected an integer, got {value!r}")


def _structure_float(value: Any, _: type) -> float:
    _reject_bool(value, "a number")
    if isinstance(value, int | float):
        return float(value)
    raise TypeError(f"expected a number, got {value!r}")


def _structure_bool(value: Any, _: type) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"expected true or false, got {value!r}")


def _structure_str(value: Any, _: type) -> str:
    if isinstance(value, str):
        return value
    raise TypeError(f"expected a string, got {value!r}")


def _structure_enum(value: Any, cls: type[enum.Enum]) -> enum.Enum:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"expected one of {allowed}, got {value!r}") from None


def make_converter() -> cattrs.Converter:
    """A strict converter: no silent int/str/bool coercions, enum errors list the choices."""
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(float, _structure_float)
    conv.register_structure_hook(bool, _structure_bool)
    conv.register_structure_hook(str, _structure_str)
    conv.register_structure_hook_func(
        lambda t: isinstance(t, type) and issubclass(t, enum.Enum), _structure_enum
    )
    conv.register_unstructure_hook_func(
        lambda t: isinstance(t, type) and issubclass(t, enum.Enum), lambda e: e.value
    )
    return conv


CONVERTER = make_converter()


def _attrs_class(tp: Any) -> type | None:
    """The attrs class inside ``tp`` (also through ``X | None``), if any."""
    if isinstance(tp, type) and attrs.has(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if isinstance(arg, type) and attrs.has(arg):
                return arg
    return None


def unknown_key_problems(raw: Mapping[str, Any], cls: type, prefix: str = "") -> list[Problem]:
    """Every key in ``raw`` that ``cls`` lacks, with a did-you-mean, recursing into sections."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in attrs.fields(cls)]
    problems: list[Problem] = []
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {names}"
            problems.append((dotted, f"unknown key; {hint}"))
            continue
        inner = _attrs_class(hints[key])
        if inner is not None:
            if isinstance(value, Mapping):
                problems += unknown_key_problems(value, inner, f"{dotted}.")
            else:
                problems.append((dotted, f"is a table; set its keys as {dotted}.<key>=..."))
    return problems


def _leaf_errors(exc: BaseException, path: str) -> list[Problem]:
    """Flatten cattrs' nested validation errors into ``(dotted key, message)`` pairs."""
    if isinstance(exc, ClassValidationError | IterableValidationError):
        out: list[Problem] = []
        for sub in exc.exceptions:
            notes = getattr(sub, "__notes__", [])
            name = getattr(notes[-1], "name", None) if notes else None
            index = getattr(notes[-1], "index", None) if notes else None
            if name is not None:
                sub_path = f"{path}.{name}" if path else str(name)
            elif index is not None:
                sub_path = f"{path}[{index}]"
            else:
                sub_path = path
            out += _leaf_errors(sub, sub_path)
        return out
    return [(path, str(exc))]


def structure_config(raw: Mapping[str, Any]) -> JobConfig:
    """Build a ``JobConfig`` from a nested dict, or raise ``ConfigError`` listing every problem."""
    problems = unknown_key_problems(raw, JobConfig)
    if problems:
        raise ConfigError([f"{k}: {m}" for k, m in problems])
    try:
        config = CONVERTER.structure(dict(raw), JobConfig)
    except (ClassValidationError, IterableValidationError) as exc:
        raise ConfigError([f"{k}: {m}" for k, m in _leaf_errors(exc, "")]) from None
    problems = validate_config(config)
    if problems:
        raise ConfigError([f"{k}: {m}" for k, m in problems])
    return config


def validate_config(config: JobConfig) -> list[Problem]:
    """All range and cross-section problems of an otherwise well-typed config."""
    problems: list[Problem] = []
    for field in attrs.fields(JobConfig):
        problems += getattr(config, field.name).problems()
    return problems + cross_section_problems(config)


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


def read_toml(path: pathlib.Path) -> dict[str, Any]:
    """Parse a TOML file, turning a missing file or a syntax error into a ``ConfigError``."""
    if not path.is_file():
        raise ConfigError(
            [f"{path}: config file not found; pass a TOML file such as configs/train/debug.toml"]
        )
    try:
        return tomli.loads(path.read_text())
    except tomli.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: invalid TOML ({exc}); fix the file's syntax"]) from None


def load_config(argv: Sequence[str]) -> LoadedConfig:
    """``argv`` is ``[config.toml, --section.key=value, ...]``; returns the validated config."""
    if not argv or argv[0].startswith("--"):
        raise ConfigError(
            ["missing config file: usage: train.py CONFIG.toml [--section.key=value ...]"]
        )
    source = pathlib.Path(argv[0])
    overrides, cli_problems = parse_cli(argv[1:])
    raw = read_toml(source)
    try:
        config = structure_config(apply_overrides(raw, overrides))
    except ConfigError as exc:
        raise ConfigError(cli_problems + exc.lines) from None
    if cli_problems:
        raise ConfigError(cli_problems)
    if config.run.dir is None:
        config = attrs.evolve(config, run=attrs.evolve(config.run, dir=f"runs/{source.stem}"))
    return LoadedConfig(config=config, source=source, overrides=tuple(argv[1:]))


def unstructure_config(config: JobConfig) -> dict[str, Any]:
    """The config as plain TOML-able values (None fields dropped, tuples as lists)."""
    return _drop_none(CONVERTER.unstructure(config))


def _drop_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_drop_none(v) for v in value]
    return value
