"""The storage seam's object-store side against a real S3 endpoint (moto's server): saves in
every async mode record every object, the same table of damage as on a disk is named before
anything loads, a checkpoint without its marker is invisible, retention removes the marker
first, and a re-save of a step replaces it."""

from __future__ import annotations

import pytest
import torch

from forge.checkpoint.checkpointer import Checkpointer
from forge.checkpoint.integrity import CHECKSUMS, recorded_checksums, verify_checkpoint
from forge.checkpoint.object_path import ObjectPath
from forge.checkpoint.paths import location
from forge.checkpoint.policy import SaveSchedule
from forge.checkpoint.resume import resolve_resume
from forge.checkpoint.storage import ObjectStorage
from forge.checkpoint.store import (
    TRAIN_STATE,
    apply_retention,
    latest_step,
    list_steps,
    load_checkpoint,
    remove_stale_temporaries,
    step_dir,
)
from forge.errors import CheckpointSaveError
from forge.model.transformer import Transformer
from tests.integration import test_checkpoint_integrity as on_disk
from tests.integration.test_checkpoint_integrity import (
    CFG,
    DAMAGE,
    MODES,
    model_and_optimizer,
    shard_of,
    swap_in_the_older_shard,
    train_state,
)
from tests.object_store import ENV, new_bucket, s3


@pytest.fixture(scope="module")
def aws(s3_endpoint):
    """The AWS variables for this module's tests (a module-wide monkeypatch)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**ENV, "AWS_ENDPOINT_URL": s3_endpoint}.items():
            patch.setenv(name, value)
        yield s3_endpoint


def save_two_steps(root: ObjectPath, mode) -> None:
    model, opt = model_and_optimizer()
    ck = Checkpointer(root, mode, 0, 1)
    try:
        for step in (1, 2):
            ck.save(step, model, opt, train_state(step))
            ck.wait()
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
    finally:
        ck.close()


@pytest.fixture(scope="module")
def saved(aws) -> str:
    """step_1 and step_2 (synchronous saves) in a bucket of their own, as a pristine copy."""
    bucket = new_bucket(aws)
    save_two_steps(location(f"s3://{bucket}/pristine"), MODES[0])
    return bucket


@pytest.fixture
def ckpt(saved, aws, request) -> ObjectPath:
    """A copy of the pristine checkpoints, for one test to damage."""
    fs = s3(aws)
    name = f"{saved}/copy-{abs(hash(request.node.nodeid))}"
    fs.copy(f"{saved}/pristine", name, recursive=True)
    return location(f"s3://{name}")  # type: ignore[return-value]


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_every_object_of_a_committed_checkpoint_is_recorded_in_every_mode(aws, mode):
    root = location(f"s3://{new_bucket(aws)}/ckpt")
    save_two_steps(root, mode)  # type: ignore[arg-type]
    path = step_dir(root, 2)
    record = recorded_checksums(path)
    stored = {p.name for p in path.iterdir() if p.name != CHECKSUMS}
    assert record is not None and set(record.files) == stored
    assert {".metadata", TRAIN_STATE, "rng_rank0.pt", "__0_0.distcp"} <= stored
    assert verify_checkpoint(path) is True and latest_step(root) == 2
    model = Transformer(CFG)
    load_checkpoint(path, model, None)
    expected, _ = model_and_optimizer()
    with torch.no_grad():
        next(expected.parameters()).add_(1.0)  # step_2 was saved after one change
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), expected.parameters(), strict=True)
    )


def swap_in_the_older_object(path):
    """``swap_in_the_older_shard`` in a store (no ``shutil.copyfile`` there)."""
    shard_of(path).write_bytes(shard_of(path.parent / "step_1").read_bytes())


# the disk's table of damage, each case done to objects
STORE_DAMAGE = [
    (case, swap_in_the_older_object if damage is swap_in_the_older_shard else damage, *rest)
    for case, damage, *rest in DAMAGE
]


@pytest.mark.parametrize(
    ("damage", "message", "by_length"),
    [c[1:] for c in STORE_DAMAGE],
    ids=[c[0] for c in STORE_DAMAGE],
)
def test_damaged_objects_are_named_before_anything_loads(ckpt, damage, message, by_length):
    """The disk's test, on objects."""
    on_disk.test_damaged_bytes_are_named_before_anything_loads(ckpt, damage, message, by_length)


def test_a_damaged_newest_checkpoint_gives_way_to_the_older_one(ckpt):
    on_disk.test_a_damaged_newest_checkpoint_gives_way_to_the_older_one(ckpt)


def test_a_checkpoint_without_its_marker_is_invisible_and_removed_at_start(ckpt):
    (step_dir(ckpt, 2) / CHECKSUMS).unlink()  # as if the upload died before the commit
    assert list_steps(ckpt) == [1]
    plan = resolve_resume(ckpt, None)
    assert plan.path == step_dir(ckpt, 1) and plan.fallbacks == () and plan.skipped == ()
    assert remove_stale_temporaries(ckpt) == ["step_2"]
    assert not step_dir(ckpt, 2).exists() and step_dir(ckpt, 1).exists()


def test_latest_naming_a_vanished_checkpoint_is_reported_and_the_newest_used(ckpt):
    (ckpt / "latest").write_text("step_7")
    plan = resolve_resume(ckpt, None)
    assert plan.path == step_dir(ckpt, 2)
    assert plan.latest_note is not None and "step_7, which does not exist" in plan.latest_note


def test_latest_holding_bytes_that_are_not_text_names_no_checkpoint(ckpt):
    (ckpt / "latest").write_bytes(b"garbage\xff\x00")
    plan = resolve_resume(ckpt, None)
    assert plan.path == step_dir(ckpt, 2)
    assert plan.latest_note is not None and "not a step_<N> folder" in plan.latest_note


def test_retention_keeps_the_newest(ckpt):
    assert apply_retention(ckpt, 1, SaveSchedule(interval=1)) == [1]
    assert list_steps(ckpt) == [2] and not step_dir(ckpt, 1).exists()


def test_retention_removes_the_marker_first(ckpt, monkeypatch):
    """A removal that fails after the marker leaves the checkpoint invisible, never visible
    and half-removed (and the run goes on: removal is best effort, as on a disk)."""

    def unreachable(self):
        raise OSError("the store went away")

    monkeypatch.setattr(ObjectPath, "remove_tree", unreachable)
    apply_retention(ckpt, 1, SaveSchedule(interval=1))
    assert list_steps(ckpt) == [2] and (step_dir(ckpt, 1) / TRAIN_STATE).exists()


def test_a_step_saved_again_loses_its_old_marker_before_anything_is_written(ckpt, monkeypatch):
    def failing_writer(self, staging, pool):
        raise RuntimeError("the write failed")

    monkeypatch.setattr(ObjectStorage, "writer", failing_writer)
    model, opt = model_and_optimizer()
    ck = Checkpointer(ckpt, MODES[0], 0, 1)
    try:
        with pytest.raises(CheckpointSaveError, match="the write failed"):
            ck.save(2, model, opt, train_state(2))
    finally:
        ck.close()
    assert list_steps(ckpt) == [1] and not step_dir(ckpt, 2).exists()


def test_a_save_refused_before_writing_leaves_the_committed_step_alone(ckpt):
    """The staging place of an object store is the step's own prefix: a save of step_2
    refused for non-finite weights must not remove the committed step_2."""
    model, opt = model_and_optimizer()
    with torch.no_grad():
        next(model.parameters())[0] = float("nan")
    ck = Checkpointer(ckpt, MODES[0], 0, 1)
    try:
        with pytest.raises(CheckpointSaveError, match="not finite"):
            ck.save(2, model, opt, train_state(2))
    finally:
        ck.close()
    assert list_steps(ckpt) == [1, 2] and verify_checkpoint(step_dir(ckpt, 2)) is True


def test_a_step_saved_again_is_committed_whole_over_the_earlier_save(ckpt):
    """Its old marker goes first; a leftover object of the earlier save (a run with more
    ranks) is recorded with the new save, which verifies and loads the new weights."""
    leftover = step_dir(ckpt, 2) / "__9_0.distcp"
    leftover.write_bytes(b"x")
    model, opt = model_and_optimizer()
    with torch.no_grad():
        next(model.parameters()).mul_(3.0)
    ck = Checkpointer(ckpt, MODES[0], 0, 1)
    try:
        ck.save(2, model, opt, train_state(2))
    finally:
        ck.close()
    path = step_dir(ckpt, 2)
    assert ObjectStorage().is_complete(path) and verify_checkpoint(path) is True
    loaded = Transformer(CFG)
    load_checkpoint(path, loaded, None)
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters(), strict=True)
    )
