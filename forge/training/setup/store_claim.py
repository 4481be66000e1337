"""One run per checkpoint directory: a local one or an object-store prefix holds
``owner.json``, naming the run that writes there (a token kept in that run's directory, its
path and host); another run directory pointed at it is refused, naming the owner. The locks
of ``forge.training.records.run_dir`` keep out a second process at once; the claim keeps out
another run directory at any later time (a run continued elsewhere starts from
``checkpoint.load_path``). An object store's prefix is also probed before anything is
written: the bucket exists, the credentials are accepted, the prefix is writable, and the
store answers within ``checkpoint.storage_timeout_s`` (each call of the probe and the claim
waits that long at most: ``ObjectPath.answer``).

Stores offer no lock with a lease, so two runs started at the same instant could both claim
an empty prefix (the window is one round trip); a run restarted, from any host, with its own
run directory is always the owner. A checkpoint directory written before claims existed is
claimed by the first run directory that starts with it.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import socket
import uuid

import attrs

from forge.checkpoint.object_path import ObjectPath, StoreTimeoutError
from forge.checkpoint.paths import CheckpointPath
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
    if prefix.protocol in BUCKET_PROTOCOLS and not bucket:
        return f"{key}: {prefix}: names no bucket; give {prefix.protocol}://<bucket>/<prefix>"

    def reach() -> None:
        try:  # a listing: reaches the store with these credentials
            prefix.fs.ls(prefix.key, detail=False)
        except FileNotFoundError:  # a new prefix, or no bucket: the bucket's root says which
            if prefix.protocol in BUCKET_PROTOCOLS:
                prefix.fs.ls(bucket, detail=False)

    try:
        prefix.answer(reach)
    except StoreTimeoutError as exc:
        return f"{key}: {exc}"
    except FileNotFoundError:
        return f"{key}: {prefix}: the bucket '{bucket}' does not exist; create it or fix the URL"
    except PermissionError as exc:
        return f"{key}: {prefix}: access denied ({one_line(exc)}); {CREDENTIALS}"
    except Exception as exc:  # the store's own: no credentials, no connection, bad options
        cause = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:240]
        return f"{key}: {prefix}: the store cannot be used ({cause}); {CREDENTIALS}"
    return None


CREDENTIALS = (
    "check the endpoint and credentials (the store's environment, e.g. AWS_ACCESS_KEY_ID, "
    "AWS_ENDPOINT_URL, or checkpoint.storage_options)"
)


@attrs.frozen
class Claim:
    """What a claim wrote (for a run that then never starts to take back): the owner
    object and the token file, each when this claim created it."""

    owner: CheckpointPath | None = None
    token_file: pathlib.Path | None = None

    def withdraw(self) -> None:
        """Best effort, each part on its own: a store that refuses to delete the owner (a
        read-only prefix) does not keep the token file, and so the run directory, behind."""
        if self.owner is not None:
            with contextlib.suppress(OSError):
                self.owner.unlink(missing_ok=True)
        if self.token_file is not None:
            with contextlib.suppress(OSError):
                self.token_file.unlink(missing_ok=True)


def claim_prefix(key: str, prefix: CheckpointPath, run_dir: pathlib.Path) -> Claim:
    """Make ``prefix`` (a checkpoint directory, local or in a store) this run's
    (``run_dir``'s), or raise ``StoreClaimError`` naming its owner or why it cannot be
    written; nothing is written when it is refused. Returns what it wrote."""
    token_file = run_dir / OWNER_TOKEN
    token = token_file.read_text().strip() if token_file.is_file() else uuid.uuid4().hex
    owner = prefix / OWNER
    try:
        recorded = json.loads(owner.read_text())
    except FileNotFoundError:
        recorded = None
    except StoreTimeoutError as exc:
        raise StoreClaimError(f"{key}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise StoreClaimError(f"{key}: {owner}: unreadable ({one_line(exc)})") from None
    if isinstance(recorded, dict) and recorded.get("token") == token:
        return Claim()
    if recorded is not None:
        holder = recorded if isinstance(recorded, dict) else {}
        raise StoreClaimError(
            f"{key}: {prefix} holds the checkpoints of another run (run.dir "
            f"{holder.get('run_dir', '?')} on {holder.get('host', '?')}); choose another "
            f"{key} (checkpoint.load_path starts a run from another's checkpoint), or delete "
            f"{owner} if that run is gone for good"
        )
    record = {"token": token, "run_dir": str(run_dir.resolve()), "host": socket.gethostname()}
    claim = Claim(owner, None if token_file.is_file() else token_file)
    try:
        token_file.write_text(token + "\n")  # first: no owner object names a lost token
    except BaseException as exc:
        Claim(token_file=claim.token_file).withdraw()
        if isinstance(exc, OSError):
            raise StoreClaimError(f"run.dir: cannot write {token_file} ({one_line(exc)})") from None
        raise
    written = False
    try:
        owner.write_text(json.dumps(record, indent=1))
        written = True
        owner.read_text()  # a prefix this run may write but not read: no resume could read it
    except BaseException as exc:
        # all of it: an owner whose write failed, timed out or was cut short by a signal
        # (set-up interrupted) may have been stored all the same
        claim.withdraw()
        if isinstance(exc, OSError):
            raise claim_refusal(key, prefix, exc, written) from None
        raise
    return claim


def claim_refusal(key: str, prefix: CheckpointPath, exc: OSError, written: bool) -> StoreClaimError:
    """Why a claim failed: the store did not answer, or refused to write the owner, or to
    read it back once ``written``."""
    if isinstance(exc, StoreTimeoutError):
        return StoreClaimError(f"{key}: {exc}")
    if not written:
        return StoreClaimError(
            f"{key}: cannot write to {prefix} ({one_line(exc)}): a read-only prefix? {CREDENTIALS}"
        )
    return StoreClaimError(
        f"{key}: cannot read back {prefix / OWNER} ({one_line(exc)}): a write-only prefix? "
        f"{CREDENTIALS}"
    )
