"""What every config section shares: problems as ``(key, message)`` pairs and the range
checks that produce them."""

from __future__ import annotations

import re

Problem = tuple[str, str]

# Linux's limits (NAME_MAX, PATH_MAX) on the common filesystems: a longer name fails in the
# kernel (ENAMETOOLONG) only when first used, deep inside set-up
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4095


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


def url_scheme(value: str) -> str | None:
    """The scheme of a URL-shaped ``value`` (``s3`` of ``s3://bucket/prefix``), else None."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", value)
    return match.group(1) if match else None


def usable_path(problems: list[Problem], key: str, value: str | None) -> None:
    """A path the operating system can take: not a URL (``s3://...`` would silently become a
    local folder named ``s3:``), no NUL byte, no name longer than 255 bytes, at most 4095
    bytes in all (unset and empty are left to ``not_empty``)."""
    if not value:
        return
    if (scheme := url_scheme(value)) is not None:
        problems.append(
            (
                key,
                f"'{value}' is a URL ({scheme}://), and forge reads and writes local (or "
                "mounted) paths only: mount the store (s3fs, gcsfuse, ...) and give the mounted "
                "path",
            )
        )
        return
    if "\0" in value:
        problems.append((key, "contains a NUL byte, which no file name can hold; fix the path"))
        return
    encoded = value.encode("utf-8", "surrogateescape")
    if len(encoded) > PATH_MAX_BYTES:
        problems.append(
            (key, f"is {len(encoded)} bytes long, over the {PATH_MAX_BYTES} a path may be")
        )
        return
    for name in encoded.split(b"/"):
        if len(name) > NAME_MAX_BYTES:
            shown = name[:24].decode("utf-8", "replace")
            problems.append(
                (
                    key,
                    f"the name '{shown}...' is {len(name)} bytes long, over the "
                    f"{NAME_MAX_BYTES} a file or folder name may be; shorten it",
                )
            )
            return
