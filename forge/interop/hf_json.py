"""The JSON values of a Hugging Face folder, checked and shown as one-line messages name
them: a value from the user's file is quoted, cut short, and typed the way JSON names it."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

INT_LIMIT = 2**63  # forge's config holds 64-bit integers


def shown(value: object, limit: int = 80) -> str:
    """``value`` as a message shows it: a string quoted, anything else as JSON writes it, cut
    to ``limit`` characters (the value comes from the user's file)."""
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def listed(items: Sequence[str], limit: int = 3) -> str:
    """The first ``limit`` items, comma-separated, and how many more there are."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def json_kind(value: object) -> str:
    """What JSON calls ``value``'s type, with an article (for 'expected an object, got ...')."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return kinds.get(type(value), "a number")


def decode_json(data: bytes) -> tuple[object, str | None]:
    """The JSON document in ``data``, or None and why there is none (not UTF-8, empty, not
    JSON, nested beyond what Python's parser follows)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        where = f"byte 0x{data[exc.start]:02x} at offset {exc.start}"
        return None, f"not UTF-8 ({where}); save it as UTF-8 JSON"
    if not text.strip():
        return None, "not JSON (the file is empty)"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    except RecursionError:
        return None, "not JSON that can be read (nested too deeply)"


def int_problem(key: str, value: object) -> str | None:
    """Why ``value`` is not an integer > 0 that fits in 64 bits, if it is not."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{key}: expected an integer, got {shown(value)}"
    if value >= INT_LIMIT:
        return f"{key}: {value} is out of range: must fit in 64 bits (< 2**63)"
    if value <= 0:
        return f"{key}: must be > 0, got {value}"
    return None


def count_problem(key: str, value: object) -> str | None:
    """Why ``value`` is not an integer >= 0 that fits in 64 bits (a count that may be none),
    if it is not."""
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return f"{key}: must be >= 0, got {value}"
    return None if value == 0 and not isinstance(value, bool) else int_problem(key, value)


def number_problem(key: str, value: object) -> str | None:
    """Why ``value`` is not a finite number > 0 (within 64 bits), if it is not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{key}: expected a number, got {shown(value)}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key}: expected a finite number, got {shown(value)}"
    if value >= INT_LIMIT:
        return f"{key}: {value} is out of range: must be < 2**63"
    if value <= 0:
        return f"{key}: must be > 0, got {value}"
    return None


def bool_problem(key: str, value: object) -> str | None:
    """Why ``value`` is not a JSON boolean, if it is not."""
    return None if isinstance(value, bool) else f"{key}: expected true or false, got {shown(value)}"


def given(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``config[key]``, or ``default`` when it is absent or null (as transformers reads it)."""
    value = config.get(key)
    return default if value is None else value
