"""One run per object-store prefix: what the run directory's lock is to a local checkpoint
directory. A prefix holds ``owner.json``, naming the run that writes there (a token kept in
that run's directory, its path and host); another run directory pointed at the prefix is
refused, naming the owner. The store is also probed before anything is written: the bucket
exists, the credentials are accepted, the prefix is writable.

Stores offer no lock with a lease, so two runs started at the same instant could both claim
an empty prefix (the window is one round trip); a run restarted, from any host, with its own
run directory is always the owner.
"""

from __future__ import annotations

import json
import pathlib
import socket
import uuid

from forge.checkpoint.object_path import ObjectPath
from forge.errors import UserInputError, one_line

OWNER = "owner.json"  # in the prefix
OWNER_TOKEN = ".forge.store_owner"  # in the run directory
BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})


class StoreClaimError(UserInputError):
    """The prefix belongs to another run, or cannot be written."""


def store_problem(key: str, prefix: ObjectPath) -> str | None:
    """Why the run cannot use ``prefix`` (reads only): the store is unreachable, refuses the
    credentials, or its bucket does not exist."""
    bucket = prefix.key.split("/", 1)[0]
    try:
        try:  # a listing: reaches the store with these credentials
            prefix.fs.ls(prefix.key, detail=False)
        except FileNotFoundError:  # a new prefix, or no bucket: the bucket's root says which
            if prefix.protocol in BUCKET_PROTOCOLS:
                prefix.fs.ls(bucket, detail=False)
    except FileNotFoundError:
        return f"{key}: {prefix}: the bucket '{bucket}' does not exist; create it or fix the URL"
    except PermissionError as exc:
        return f"{key}: {prefix}: access denied ({one_line(exc)}); {CREDENTIALS}"
    except OSError as exc:
        return f"{key}: {prefix}: the store cannot be used ({one_line(exc)}); {CREDENTIALS}"
    return None


CREDENTIALS = (
    "check the endpoint and credentials (the store's environment, e.g. AWS_ACCESS_KEY_ID, "
    "AWS_ENDPOINT_URL, or checkpoint.storage_options)"
)


def claim_prefix(key: str, prefix: ObjectPath, run_dir: pathlib.Path) -> None:
    """Make ``prefix`` this run's (``run_dir``'s), or raise ``StoreClaimError`` naming its
    owner or why it cannot be written; nothing is written when it is refused."""
    token_file = run_dir / OWNER_TOKEN
    token = token_file.read_text().strip() if token_file.is_file() else uuid.uuid4().hex
    owner = prefix / OWNER
    try:
        recorded = json.loads(owner.read_text())
    except FileNotFoundError:
        recorded = None
    except (OSError, ValueError) as exc:
        raise StoreClaimError(f"{key}: {owner}: unreadable ({one_line(exc)})") from None
    if isinstance(recorded, dict) and recorded.get("token") == token:
        return
    if recorded is not None:
        holder = recorded if isinstance(recorded, dict) else {}
        raise StoreClaimError(
            f"{key}: {prefix} holds the checkpoints of another run (run.dir "
            f"{holder.get('run_dir', '?')} on {holder.get('host', '?')}); choose another "
            f"{key}, or delete {owner} if that run is gone for good"
        )
    record = {"token": token, "run_dir": str(run_dir.resolve()), "host": socket.gethostname()}
    try:
        owner.write_text(json.dumps(record, indent=1))
    except OSError as exc:
        raise StoreClaimError(
            f"{key}: cannot write to {prefix} ({one_line(exc)}): a read-only prefix? {CREDENTIALS}"
        ) from None
    token_file.write_text(token + "\n")
