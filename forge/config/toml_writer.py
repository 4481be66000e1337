"""Write a resolved config back as TOML (tomli only reads).

A tiny emitter for the value kinds a ``JobConfig`` holds: strings, numbers, booleans, lists
(of scalars or inline tables) and nested tables. Kept here rather than adding tomli-w as a
core dependency.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def _key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else json.dumps(key)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic strings
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, Mapping):  # inside a list: an inline table
        return "{" + ", ".join(f"{_key(k)} = {_scalar(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def dumps_toml(data: Mapping[str, Any], _prefix: str = "") -> str:
    """TOML text for a nested mapping: scalars first, then one ``[table]`` per sub-mapping."""
    lines = [f"{k} = {_scalar(v)}" for k, v in data.items() if not isinstance(v, Mapping)]
    out = "\n".join(lines) + ("\n" if lines else "")
    for key, value in data.items():
        if isinstance(value, Mapping):
            name = f"{_prefix}{_key(key)}"
            body = dumps_toml(value, f"{name}.")
            out += f"\n[{name}]\n{body}"
    return out
