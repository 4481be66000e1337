"""What every config section shares: problems as ``(key, message)`` pairs and the range
checks that produce them."""

from __future__ import annotations

Problem = tuple[str, str]


def positive(problems: list[Problem], key: str, value: float) -> None:
    """Add a problem unless ``value > 0``."""
    if value <= 0:
        problems.append((key, f"must be > 0, got {value}"))


def non_negative(problems: list[Problem], key: str, value: float) -> None:
    """Add a problem unless ``value >= 0``."""
    if value < 0:
        problems.append((key, f"must be >= 0, got {value}"))


def not_empty(problems: list[Problem], key: str, value: str | None) -> None:
    """An optional path: unset is fine, an empty string names nothing."""
    if value is not None and not value.strip():
        problems.append((key, "must not be empty; leave it out for the default"))
