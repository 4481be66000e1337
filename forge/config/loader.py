"""Load a ``JobConfig``: defaults → TOML file → ``--section.key=value`` overrides → validation.

Every problem is collected and raised together as one ``ConfigError`` whose lines each name the
dotted key and the fix. Nothing here touches the disk except reading the TOML file.
"""

from __future__ import annotations

import difflib
import enum
import math
import pathlib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import cattrs
import tomli
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)

from forge.config.combinations import cross_section_problems
from forge.config.help import USAGE
from forge.config.overrides import apply_overrides, parse_cli
from forge.config.ranges import usable_path
from forge.config.sections import JobConfig, Problem
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


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what torch (and a C long) can hold


def _structure_int(value: Any, _: type) -> int:
    _reject_bool(value, "an integer")
    if not isinstance(value, int):  # 1e3 too: the docs promise strict types
        raise TypeError(f"expected an integer, got {value!r}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{value} is out of range: must fit in 64 bits (|value| < 2**63)")
    return value


def _structure_float(value: Any, _: type) -> float:
    _reject_bool(value, "a number")
    if not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value}")
    return float(value)


class ListItemErrors(ValueError):
    """The items of a fixed-length list that did not structure, by index."""

    def __init__(self, errors: list[tuple[int, Exception]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"[{i}] {e}" for i, e in errors))


def _is_fixed_tuple(tp: Any) -> bool:
    args = typing.get_args(tp)
    return typing.get_origin(tp) is tuple and bool(args) and Ellipsis not in args


def _fixed_tuple_hook(tp: Any) -> Any:
    """``tuple[float, float]``: a list of exactly that many values, each structured in turn."""
    args = typing.get_args(tp)

    def structure(value: Any, _: type) -> tuple:
        if not isinstance(value, list | tuple):
            raise TypeError(f"expected a list of {len(args)} values, got {value!r}")
        if len(value) != len(args):
            raise ValueError(f"expected {len(args)} values, got {len(value)}")
        items, errors = [], []
        for index, (item, item_type) in enumerate(zip(value, args, strict=True)):
            try:
                items.append(CONVERTER.structure(item, item_type))
            except (TypeError, ValueError) as exc:
                errors.append((index, exc))
        if errors:
            raise ListItemErrors(errors)
        return tuple(items)

    return structure


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


def _structure_keyword_tables(value: Any, _: type) -> dict[str, dict[str, Any]]:
    """``[hooks.args]``: one table of keyword arguments per class, values kept as TOML gave
    them (the class's constructor checks them)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a table of tables, got {value!r}")
    for key, kwargs in value.items():
        if not isinstance(kwargs, Mapping):
            raise ValueError(f'"{key}" must be a table of keyword arguments, got {kwargs!r}')
    return {str(k): dict(v) for k, v in value.items()}


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
    conv.register_structure_hook_factory(_is_fixed_tuple, _fixed_tuple_hook)
    conv.register_structure_hook_func(
        lambda t: t == dict[str, dict[str, Any]], _structure_keyword_tables
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


def leaf_errors(exc: BaseException, path: str) -> list[Problem]:
    """Flatten cattrs' nested validation errors into ``(dotted key, message)`` pairs."""
    if isinstance(exc, ClassValidationError | IterableValidationError):
        out: list[Problem] = []
        for sub in exc.exceptions:
            notes = getattr(sub, "__notes__", None) or [None]
            note = notes[-1]  # cattrs' own notes are typed; a plain str note names nothing
            if isinstance(note, AttributeValidationNote):
                sub_path = f"{path}.{note.name}" if path else note.name
            elif isinstance(note, IterableValidationNote):
                sub_path = f"{path}[{note.index}]"
            else:
                sub_path = path
            out += leaf_errors(sub, sub_path)
        return out
    if isinstance(exc, ListItemErrors):
        return [p for index, sub in exc.errors for p in leaf_errors(sub, f"{path}[{index}]")]
    if isinstance(exc, ForbiddenExtraKeysError):  # an entry of an array of tables
        names = [f.name for f in attrs.fields(exc.cl)]
        out = []
        for key in sorted(exc.extra_fields):
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean '{path}.{close[0]}'?" if close else f"valid keys: {names}"
            out.append((f"{path}.{key}", f"unknown key; {hint}"))
        return out
    if isinstance(exc, KeyError):  # a required key left out
        return [(path, "is required")]
    return [(path, str(exc))]


def known_keys_only(raw: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """``raw`` without the keys ``cls`` lacks (reported by ``unknown_key_problems``), so the
    rest of a section can still be type-checked."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in hints:
            continue
        inner = _attrs_class(hints[key])
        if inner is not None and not isinstance(value, Mapping):
            continue  # reported by unknown_key_problems: a scalar where a table belongs
        out[key] = known_keys_only(value, inner) if inner is not None else value
    return out


def structure_section(name: str, raw: Any, tp: Any) -> tuple[Any, list[Problem]]:
    """One top-level section, or its type problems (then None)."""
    try:
        return CONVERTER.structure(raw, tp), []
    except (ClassValidationError, IterableValidationError, ListItemErrors) as exc:
        return None, leaf_errors(exc, name)
    except (TypeError, ValueError) as exc:
        return None, [(name, str(exc))]


@attrs.frozen
class CheckedConfig:
    """A config with its problems: unknown keys, types, ranges and (when every section is
    sound) cross-section combinations. A section that does not structure holds its defaults."""

    config: JobConfig
    problems: tuple[Problem, ...]

    @property
    def broken(self) -> frozenset[str]:
        """The sections (top-level names) some problem names: checks that read them wait."""
        return frozenset(section_of(key) for key, _ in self.problems)


def section_of(key: str) -> str:
    """``model.dim`` → ``model``; ``freeze[0].module`` → ``freeze``."""
    return key.split(".", 1)[0].split("[", 1)[0]


def single_table_problems(
    name: str, section: Mapping[str, Any], section_type: type
) -> list[tuple[str, str]]:
    """The keys of ``section`` that hold an array of tables (``[[eval.tasks]]``) but were
    written as one table (``[eval.tasks]``): one problem each, naming the double brackets."""
    problems = []
    for field, tp in typing.get_type_hints(section_type).items():
        if typing.get_origin(tp) is tuple and isinstance(section.get(field), Mapping):
            args = typing.get_args(tp)
            if args and attrs.has(args[0]):
                key = f"{name}.{field}"
                problems.append(
                    (key, f"a single table [{key}] where an array of tables belongs; write each "
                     f"entry under [[{key}]] (double brackets)")
                )  # fmt: skip
    return problems


def check_config(raw: Mapping[str, Any]) -> CheckedConfig:
    """Structure a nested dict into a ``JobConfig`` and collect every problem of all sections
    in one pass (a section that does not structure is skipped for range checks; cross-section
    checks need every section sound)."""
    problems = unknown_key_problems(raw, JobConfig)
    known = known_keys_only(raw, JobConfig)
    sections: dict[str, Any] = {}
    for name, tp in typing.get_type_hints(JobConfig).items():
        if name not in known:
            continue
        if typing.get_origin(tp) is tuple:  # an array of tables: [[freeze]]
            if not isinstance(known[name], list):
                problems.append(
                    (name, f"expected an array of tables ([[{name}]]), got {known[name]!r}")
                )
                continue
            entries, type_problems = structure_section(name, known[name], tp)
            problems += type_problems
            if entries is not None:
                sections[name] = entries
                for i, entry in enumerate(entries):
                    problems += entry.problems(f"{name}[{i}]")
            continue
        if not isinstance(known[name], Mapping):
            continue  # reported by unknown_key_problems: a scalar where a table belongs
        single = single_table_problems(name, known[name], tp)
        if single:  # cattrs would read the table's keys as entries: say what was meant
            problems += single
            continue
        section, type_problems = structure_section(name, dict(known[name]), tp)
        problems += type_problems
        if section is not None:
            sections[name] = section
            problems += section.problems()
    config = JobConfig(**sections)
    if not problems:
        problems += cross_section_problems(config)
    return CheckedConfig(config, tuple(problems))


def structure_config(raw: Mapping[str, Any]) -> JobConfig:
    """Build a ``JobConfig`` from a nested dict, or raise ``ConfigError`` listing every problem
    (``check_config``'s)."""
    checked = check_config(raw)
    if checked.problems:
        raise ConfigError([f"{k}: {m}" for k, m in checked.problems])
    return checked.config


def read_toml(path: pathlib.Path) -> dict[str, Any]:
    """Parse a TOML file, turning a missing file or a syntax error into a ``ConfigError``."""
    unusable: list[Problem] = []
    usable_path(unusable, str(path), str(path))
    if unusable:
        raise ConfigError([f"{key}: {message}" for key, message in unusable])
    if path.is_dir():
        raise ConfigError([f"{path}: is a directory; pass a TOML file inside it"])
    if not path.is_file():
        raise ConfigError(
            [f"{path}: config file not found; pass a TOML file such as configs/train/debug.toml"]
        )
    try:
        return tomli.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"{path}: not UTF-8 text (byte {exc.start}); save the config file as UTF-8"]
        ) from None
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read the config file ({exc.strerror})"]) from None
    except tomli.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: invalid TOML ({exc}); fix the file's syntax"]) from None


def load_config(argv: Sequence[str]) -> LoadedConfig:
    """``argv`` is ``[config.toml, --section.key=value, ...]``; returns the validated config."""
    loaded, lines, _ = load_config_checked(argv)
    if lines:
        raise ConfigError(lines)
    return loaded


def load_config_checked(argv: Sequence[str]) -> tuple[LoadedConfig, list[str], frozenset[str]]:
    """The config ``argv`` names, its problems as lines (the command line's, then
    ``check_config``'s) and the sections they name, for a caller that goes on checking the
    sound sections against the world. Raises ``ConfigError`` only when there is no config to
    check: no file, or a file that is not TOML."""
    if not argv or argv[0].startswith("--"):
        raise ConfigError([f"missing config file: {USAGE} (--help lists every key)"])
    source = pathlib.Path(argv[0])
    overrides, cli_problems = parse_cli(argv[1:])
    raw = read_toml(source)
    checked = check_config(apply_overrides(raw, overrides))
    config = checked.config
    if config.run.dir is None:
        config = attrs.evolve(config, run=attrs.evolve(config.run, dir=f"runs/{source.stem}"))
    loaded = LoadedConfig(config=config, source=source, overrides=tuple(argv[1:]))
    lines = cli_problems + [f"{k}: {m}" for k, m in checked.problems]
    return loaded, lines, checked.broken


def unstructure_config(config: JobConfig) -> dict[str, Any]:
    """The config as plain TOML-able values (None fields dropped, tuples as lists)."""
    return _drop_none(CONVERTER.unstructure(config))


def _drop_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_drop_none(v) for v in value]
    return value
