"""What every config section shares: problems as ``(key, message)`` pairs and the range
checks that produce them."""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Mapping
from typing import Any

Problem = tuple[str, str]

# Linux's limits (NAME_MAX, PATH_MAX) on the common filesystems: a longer name fails in the
# kernel (ENAMETOOLONG) only when first used, deep inside set-up
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4095
# the longest wait forge takes: a longer one bounds nothing, and the libraries below overflow
# on some (threading's TIMEOUT_MAX; gloo's deadline in ms: 1e10 s timed out at once)
MAX_WAIT_S = 7 * 24 * 3600.0


def positive(problems: list[Problem], key: str, value: float) -> None:
    """Add a problem unless ``value > 0``."""
    if value <= 0:
        problems.append((key, f"must be > 0, got {value}"))


def timeout_range(
    problems: list[Problem], key: str, value: float, at_least: float = 0.0, why: str = ""
) -> None:
    """Add a problem unless ``value``, a wait in seconds, is one forge can take: at least
    ``at_least`` (``why``: what a shorter one breaks), else just > 0; at most ``MAX_WAIT_S``."""
    if at_least > 0 and not value >= at_least:  # NaN included
        problems.append((key, f"must be >= {at_least:g} s, got {value:g}: {why}"))
    elif not value > 0:
        problems.append((key, f"must be > 0, got {value}"))
    elif value > MAX_WAIT_S:
        problems.append(
            (key, f"must be at most {MAX_WAIT_S:g} s (a week), got {value:g}: it bounds nothing")
        )


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


# forge's optional extras that bring an object store's fsspec package, by URL protocol
STORE_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def one_slash_scheme(value: str) -> str | None:
    """The protocol of a storage URL written with one slash (``s3:/bucket/x``, which a path
    would take for a local folder named ``s3:``), else None (``C:/runs`` is a path)."""
    from fsspec.registry import known_implementations

    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):/(?!/)", value)
    return match.group(1) if match and match.group(1).lower() in known_implementations else None


def store_url_problem(url: str) -> str | None:
    """Why fsspec cannot open ``url`` for forge: a protocol it does not know, one whose package
    is not installed (naming forge's extra that brings it) or one that outlives no process
    (``memory://``), else None."""
    from fsspec.registry import get_filesystem_class, known_implementations

    scheme = url_scheme(url) or ""
    if scheme == "memory":  # fsspec's own, in this process: accepted, it would keep nothing
        return (
            f"'{url}': memory:// keeps its files in this process alone: a checkpoint saved "
            "there is gone when the process ends, and none saved by another could be read; "
            "give a local folder or a durable store (s3://, gs://)"
        )
    if scheme not in known_implementations:
        return (
            f"'{url}': '{scheme}://' is not a storage protocol fsspec knows (s3://, gs://, "
            "and those of fsspec's registry); fix the URL"
        )
    try:
        get_filesystem_class(scheme)
    except ImportError:
        extra = STORE_EXTRAS.get(scheme)
        fix = (
            f"install forge's '{extra}' extra: pip install -e '.[{extra}]'"
            if extra
            else f"install fsspec's package for it ({known_implementations[scheme].get('err')})"
        )
        return f"'{url}': {scheme}:// needs a package that is not installed; {fix}"
    return None


# what every fsspec file system takes besides its own options (its listing cache, its
# instance cache)
FSSPEC_OPTIONS = frozenset(
    {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache"}
)


def store_options_problem(url: str, options: Mapping[str, Any]) -> str | None:
    """The first of ``options`` that the file system of ``url`` does not take (a misspelt
    option would be dropped silently: ``endpoint`` for ``endpoint_url`` talks to AWS), else
    None; None too where the store's options are not declared one by one."""
    from fsspec.registry import get_filesystem_class

    scheme = url_scheme(url) or ""
    try:
        cls = get_filesystem_class(scheme)
    except (ImportError, ValueError):
        return None  # store_url_problem says why
    params = inspect.signature(cls.__init__).parameters.values()
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if named <= {"self"}:
        return None
    known = (named - {"self"}) | FSSPEC_OPTIONS
    for name in sorted(set(options) - known):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return f"'{name}' is not an option of {scheme}:// ({cls.__name__}){hint}"
    return None


def usable_location(problems: list[Problem], key: str, value: str | None) -> None:
    """A local path (``usable_path``) or an object-store URL fsspec can open."""
    if value and url_scheme(value) is not None:
        if (problem := store_url_problem(value)) is not None:
            problems.append((key, problem))
        return
    usable_path(problems, key, value)


def usable_path(problems: list[Problem], key: str, value: str | None) -> None:
    """A path the operating system can take: not a URL (``s3://...`` would silently become a
    local folder named ``s3:``; ``usable_location`` takes both), no NUL byte, no name longer
    than 255 bytes, at most 4095 bytes in all (unset and empty are left to ``not_empty``)."""
    if not value:
        return
    if (scheme := one_slash_scheme(value)) is not None:
        problems.append(
            (
                key,
                f"'{value}' is a URL with one slash ({scheme}:/): write {scheme}://... for "
                f"the store, or ./{value} for a local folder of that name",
            )
        )
        return
    if (scheme := url_scheme(value)) is not None:
        problems.append(
            (
                key,
                f"'{value}' is a URL ({scheme}://), and this key takes a local (or mounted) "
                "path only (checkpoint.dir and checkpoint.load_path may name an object store); "
                "give a local path",
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
