"""Pins against retention (``forge.checkpoint.pins``), on a disk and in an object store: a
live pin defers a removal, a removal under way turns a reader away, an expired or damaged pin
does not count, a deferred removal is finished by the reader that unpins, and a pin is renewed
while held."""

from __future__ import annotations

import pathlib
import time

import pytest

from forge.checkpoint import pins as forge_pins
from forge.checkpoint.paths import location, write_atomically
from forge.checkpoint.pins import (
    DEFERRED,
    RETIRING,
    StepPin,
    finish_all_deferred,
    finish_deferred,
    has_marker,
    marker_path,
    pin_path,
    pins_of,
    reclaim_pins,
    remove_unless_pinned,
    write_pin,
)
from forge.checkpoint.policy import SaveSchedule
from forge.checkpoint.storage import storage_of
from forge.checkpoint.store import apply_retention, commit_checkpoint, is_complete, list_steps

NOW = 1_000_000.0


@pytest.fixture(params=["disk", "s3"])
def root(request, tmp_path):
    if request.param == "disk":
        return tmp_path / "checkpoints"
    bucket = request.getfixturevalue("s3_bucket")
    return location(f"s3://{bucket}/run/checkpoints")


def committed(root, *steps: int) -> None:
    """Checkpoints committed by the storage's own commit at ``steps`` (a metadata file each)."""
    storage = storage_of(root)
    for step in steps:
        staging = storage.staging(root, step)
        storage.prepare(root, staging)
        staging.mkdir(parents=True, exist_ok=True)
        write_atomically(staging / ".metadata", b"m")
        commit_checkpoint(root, staging, step, {"step": step})


def test_a_live_pin_defers_the_removal_and_the_reader_finishes_it(root):
    committed(root, 2, 4)
    write_pin(root, 2, "reader", NOW + 60)
    assert remove_unless_pinned(root, 2, NOW) is False
    assert is_complete(root / "step_2")
    assert has_marker(root, 2, DEFERRED) and not has_marker(root, 2, RETIRING)
    pin_path(root, 2, "reader").unlink()
    assert finish_deferred(root, 2, NOW) is True
    assert list_steps(root) == [4] and not has_marker(root, 2, DEFERRED)


def test_the_reader_never_removes_the_step_latest_names(root):
    committed(root, 2)  # e.g. a rewind made the deferred step the newest again
    write_pin(root, 2, "reader", NOW + 60)
    assert remove_unless_pinned(root, 2, NOW) is False
    pin_path(root, 2, "reader").unlink()
    assert finish_deferred(root, 2, NOW) is False
    assert list_steps(root) == [2] and not has_marker(root, 2, DEFERRED)


def test_no_deferred_removal_no_removal_by_the_reader(root):
    committed(root, 2)
    assert finish_deferred(root, 2, NOW) is False and is_complete(root / "step_2")


@pytest.mark.parametrize("text", ["", "{", '{"expires": "soon"}', "[]", '{"expires": Infinity}'])
def test_an_expired_or_damaged_pin_does_not_count_and_an_expired_one_is_taken(root, text):
    committed(root, 2, 4)
    write_pin(root, 2, "dead", NOW - 1)
    write_atomically(pin_path(root, 4, "garbled"), text.encode())
    assert remove_unless_pinned(root, 2, NOW) is True
    assert remove_unless_pinned(root, 4, NOW) is True
    assert list_steps(root) == [] and pins_of(root, 2) == []


def test_a_reader_that_finds_the_removal_under_way_gives_the_step_up(root):
    committed(root, 2)
    marker_path(root, 2, RETIRING).parent.mkdir(parents=True, exist_ok=True)
    write_atomically(marker_path(root, 2, RETIRING), b"")  # retention between mark and remove
    pin = StepPin(root, 2, "reader", 60, lambda: NOW)
    assert pin.acquired is False
    assert pins_of(root, 2) == []  # it took its pin back at once
    pin.release()


def test_a_held_pin_keeps_retention_off_until_released(root):
    committed(root, 1, 2, 3)
    schedule = SaveSchedule(interval=1)
    pin = StepPin(root, 1, "reader", 60, time.time)
    assert pin.acquired
    assert apply_retention(root, 1, schedule) == [2]  # step_3 is latest-kept, step_1 pinned
    assert list_steps(root) == [1, 3]
    pin.release()
    assert apply_retention(root, 1, schedule) == [1]
    assert list_steps(root) == [3]


def test_a_pin_is_renewed_while_held(root):
    committed(root, 2)
    pin = StepPin(root, 2, "reader", 1.0, time.time)  # renewed every third of a second
    try:
        first = pins_of(root, 2)[0].expires
        deadline = time.monotonic() + 10
        while pins_of(root, 2)[0].expires == first:
            assert time.monotonic() < deadline, "the pin was not renewed"
            time.sleep(0.05)
    finally:
        pin.release()
    assert pins_of(root, 2) == []


def test_what_a_killed_reader_left_deferred_is_taken_up_by_the_next(root):
    committed(root, 2, 4, 6)
    write_pin(root, 2, "reader", NOW + 60)
    write_pin(root, 4, "reader", NOW + 60)
    assert remove_unless_pinned(root, 2, NOW) is False
    assert remove_unless_pinned(root, 4, NOW) is False
    assert reclaim_pins(root, "reader") == [2, 4]  # the next reader of that name, at its start
    assert finish_all_deferred(root, NOW) == [2, 4]
    assert list_steps(root) == [6]


def test_a_full_disk_leaves_no_half_written_pin(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"

    def full(path, data):
        path.with_name(path.name + ".tmp").write_bytes(data[:1])  # what a write got out
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("forge.checkpoint.pins.write_atomically", full)
    with pytest.raises(OSError) as err:
        write_pin(root, 2, "reader", NOW)
    assert err.value.filename == str(pin_path(root, 2, "reader"))
    assert list((root / "pins").iterdir()) == []


def tidied_while_checked(monkeypatch, folder):
    """``mkdir(exist_ok=True)`` finds ``folder`` and, before it checks that it is a folder,
    retention's ``tidy`` removes it: FileExistsError."""
    folder.mkdir(parents=True)
    is_dir = pathlib.Path.is_dir
    raced = []

    def removed_first(path):
        if path == folder and not raced:
            raced.append(path)
            folder.rmdir()
            return False
        return is_dir(path)

    monkeypatch.setattr(pathlib.Path, "is_dir", removed_first)


def tidied_before_written(monkeypatch, folder):
    """The folder is made, then removed before the pin is written in it."""
    write = forge_pins.write_atomically
    raced = []

    def removed_first(path, data):
        if not raced:
            raced.append(path)
            folder.rmdir()
        write(path, data)

    monkeypatch.setattr("forge.checkpoint.pins.write_atomically", removed_first)


@pytest.mark.parametrize("race", [tidied_while_checked, tidied_before_written])
def test_a_pin_is_written_when_retention_removes_the_empty_folder_meanwhile(
    tmp_path, monkeypatch, race
):
    """Retention's ``tidy`` removes the pins folder when it is empty; a reader making it at
    that moment tries again (seen: ``pins: cannot be written (File exists)`` ended an
    evaluation follower beside a run keeping one checkpoint)."""
    root = tmp_path / "checkpoints"
    race(monkeypatch, root / "pins")
    write_pin(root, 2, "reader", NOW)
    assert [p.holder for p in pins_of(root, 2)] == ["reader"]
