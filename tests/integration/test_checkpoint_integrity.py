"""A committed checkpoint's bytes are recorded (``checksums.json``) in every async mode and
verified before a resume loads them; damage is named and never loaded; non-finite weights
are never committed."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct

import pytest
import torch

from forge.checkpoint.checkpointer import Checkpointer
from forge.checkpoint.integrity import (
    CHECKSUMS,
    PIECE,
    IntegrityError,
    checksums_of,
    recorded_checksums,
    verify_checkpoint,
)
from forge.checkpoint.resume import first_loadable, resolve_resume
from forge.checkpoint.store import TRAIN_STATE, CheckpointError, check_loadable, step_dir
from forge.config import ModelConfig, OptimizerConfig
from forge.config.sections import AsyncMode, Verification
from forge.errors import CheckpointSaveError
from forge.model.transformer import Transformer
from forge.optim import build_optimizer
from forge.training.records.train_state import parse_train_state

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=16)
MODES = [AsyncMode.DISABLED, AsyncMode.ASYNC, AsyncMode.ASYNC_PROCESS]


def model_and_optimizer():
    torch.manual_seed(0)
    model = Transformer(CFG)
    return model, build_optimizer(model, OptimizerConfig())


def train_state(step: int) -> dict:
    return {"step": step, "loop_state": {"step": step}}


@pytest.fixture(scope="module", params=MODES, ids=[m.value for m in MODES])
def saved(request, tmp_path_factory):
    """Checkpoints step_1 and step_2 written in the parametrized async mode (model changed
    between them), as a pristine copy for each test to damage."""
    root = tmp_path_factory.mktemp(request.param.value)
    model, opt = model_and_optimizer()
    ck = Checkpointer(root, request.param, 0, 1)
    try:
        for step in (1, 2):
            ck.save(step, model, opt, train_state(step))
            ck.wait()
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
    finally:
        ck.close()
    return root


@pytest.fixture
def ckpt(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root, symlinks=True)
    return root


def shard_of(path):
    return next(path.glob("*.distcp"))


def flip_a_bit(path):
    shard = shard_of(path)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def write_nan_weights(path):
    """NaN over the first float32 values of the shard, in place (the length stays)."""
    shard = shard_of(path)
    data = bytearray(shard.read_bytes())
    data[64:96] = struct.pack("<8f", *[float("nan")] * 8)
    shard.write_bytes(bytes(data))


def swap_in_the_older_shard(path):
    shutil.copyfile(shard_of(path.parent / "step_1"), shard_of(path))


def edit_the_step(path):
    state = json.loads((path / TRAIN_STATE).read_text())
    state["step"] = 1
    (path / TRAIN_STATE).write_text(json.dumps(state))


def truncate_the_rng_file(path):
    rng = path / "rng_rank0.pt"
    rng.write_bytes(rng.read_bytes()[:-10])


def test_every_file_of_a_committed_checkpoint_is_recorded(ckpt):
    path = step_dir(ckpt, 2)
    record = recorded_checksums(path)
    assert record is not None and record.piece == PIECE
    on_disk = {p.name for p in path.iterdir() if p.name != CHECKSUMS}
    assert set(record.files) == on_disk and {".metadata", TRAIN_STATE, "rng_rank0.pt"} <= on_disk
    assert verify_checkpoint(path) is True
    check_loadable(path, Transformer(CFG))


def rewritten_record(path: pathlib.Path, piece: object) -> None:
    """``checksums.json`` as a forge with another piece size would have written it."""
    record = json.loads((path / CHECKSUMS).read_text())
    if isinstance(piece, int) and piece > 0 and piece % 4096 == 0:
        record["files"] = checksums_of(path, list(record["files"]), piece)
    record["piece"] = piece
    (path / CHECKSUMS).write_text(json.dumps(record))


# (piece size in the record, verifies; else a fragment of the refusal)
PIECES = [
    (32 << 20, True),  # the size forge wrote before
    (8192, True),
    (0, "piece size 0 is not a positive whole number of pages"),
    (1000, "piece size 1000"),  # not page-aligned: no memory map reads it
    ("4194304", "piece size '4194304'"),
    (None, "piece size None"),
]


@pytest.mark.parametrize("piece,verdict", PIECES)
def test_a_record_is_verified_in_the_piece_size_it_names(ckpt, piece, verdict):
    path = step_dir(ckpt, 2)
    rewritten_record(path, piece)
    if verdict is True:
        assert verify_checkpoint(path) is True
        flip_a_bit(path)
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            verify_checkpoint(path)
    else:
        with pytest.raises(IntegrityError, match=verdict):
            verify_checkpoint(path)


def edited_record(**changes):
    """Damage that rewrites ``checksums.json`` with ``changes`` (a value, or a function of
    the record's ``files``), or as ``changes["whole"]`` when given."""

    def damage(path):
        record = json.loads((path / CHECKSUMS).read_text())
        if "whole" in changes:
            record = changes["whole"]
        for key, value in changes.items():
            if key != "whole":
                record[key] = value(record[key]) if callable(value) else value
        (path / CHECKSUMS).write_text(json.dumps(record))

    return damage


def flip_a_bit_with_no_record(path):
    edited_record(files={})(path)
    flip_a_bit(path)


def fifo_for(name):
    """A FIFO in place of ``name``: opened for reading, it would wait for a writer forever."""

    def damage(path):
        (path / name).unlink()
        os.mkfifo(path / name)

    return damage


def drop(name):
    return lambda files: {k: v for k, v in files.items() if k != name}


# (case, damage, message, caught under verify = "metadata" too)
DAMAGE = [
    # the record fails closed: every file of the folder must be in it, in its own shape
    ("an empty record and a flipped bit", flip_a_bit_with_no_record, "__0_0.distcp.*not in its checksum record", True),
    ("a shard missing from the record", edited_record(files=drop("__0_0.distcp")), "__0_0.distcp not in its checksum record", True),
    ("the RNG file missing from the record", edited_record(files=drop("rng_rank0.pt")), "rng_rank0.pt not in its checksum record", True),
    ("an unknown algorithm", edited_record(algorithm="md5"), "algorithm 'md5' is not one forge verifies", True),
    ("a record that is a list", edited_record(whole=[]), "not a checksum record \\(a JSON list", True),
    ("an entry of the wrong shape", edited_record(files=lambda f: f | {".metadata": [1]}), "the entry of '.metadata'", True),
    ("a flipped bit", flip_a_bit, "__0_0.distcp: checksum mismatch", False),
    ("NaN written into the weights", write_nan_weights, "__0_0.distcp: checksum mismatch", False),
    ("step_1's shard copied over step_2's", swap_in_the_older_shard, "checksum mismatch", False),
    ("the train state's step edited", edit_the_step, "train_state.json", True),
    ("a truncated RNG file", truncate_the_rng_file, "rng_rank0.pt", True),
]  # fmt: skip
# a disk's alone (an object store holds no special file): a read of a FIFO would hang
SPECIAL_FILES = [
    ("a FIFO for the RNG file", fifo_for("rng_rank0.pt"), "rng_rank0.pt: not a regular file", True),
    ("a FIFO for the train state", fifo_for(TRAIN_STATE), "train_state.json: not a regular file", True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("damage", "message", "by_length"),
    [c[1:] for c in DAMAGE + SPECIAL_FILES],
    ids=[c[0] for c in DAMAGE + SPECIAL_FILES],
)
def test_damaged_bytes_are_named_before_anything_loads(ckpt, damage, message, by_length):
    path = step_dir(ckpt, 2)
    damage(path)
    with pytest.raises(CheckpointError, match=message) as err:
        check_loadable(path, Transformer(CFG))
    assert "step_2" in str(err.value)
    if by_length:
        with pytest.raises(CheckpointError):
            check_loadable(path, Transformer(CFG), Verification.METADATA)
    else:  # same length: only the checksums see it
        check_loadable(path, Transformer(CFG), Verification.METADATA)


def test_a_damaged_newest_checkpoint_gives_way_to_the_older_one(ckpt):
    flip_a_bit(step_dir(ckpt, 2))
    plan = resolve_resume(ckpt, None)
    said = []
    path, _ = first_loadable(
        (plan.path, *plan.fallbacks), lambda p: check_loadable(p, Transformer(CFG)), said.append
    )
    assert path == step_dir(ckpt, 1)
    assert "step_2/__0_0.distcp: checksum mismatch" in said[0]


def test_a_latest_moved_back_still_resumes_the_newest_and_falls_back_past_its_damage(ckpt):
    """``latest`` names step_1: step_2, newer and complete, is chosen first; its damage makes
    it give way to step_1, as any damaged checkpoint does."""
    (ckpt / "latest").unlink()
    (ckpt / "latest").symlink_to("step_1")
    flip_a_bit(step_dir(ckpt, 2))
    plan = resolve_resume(ckpt, None)
    assert plan.path == step_dir(ckpt, 2) and plan.fallbacks == (step_dir(ckpt, 1),)
    path, _ = first_loadable(
        (plan.path, *plan.fallbacks), lambda p: check_loadable(p, Transformer(CFG))
    )
    assert path == step_dir(ckpt, 1)


def test_a_train_state_of_another_step_than_its_folder_is_refused(ckpt):
    raw = json.loads((step_dir(ckpt, 2) / TRAIN_STATE).read_text())
    good = {
        "format_version": 2,
        "step": 2,
        "tokens_seen": 0,
        "reason": "scheduled",
        "loop_state": {"step": 2},
        "loader": {"rows": 0, "steps": 0, "step_rows": 0, "cursors": [0], "digest": "0" * 16},
        "schedule": {"name": "cosine", "warmup_steps": 0, "decay_steps": 2, "total_steps": 2},
        "world_size": 1,
    }
    assert raw["step"] == 2
    parse_train_state(good, step_dir(ckpt, 2))
    for step in (1, -1):
        edited = good | {"step": step, "loop_state": {"step": step}}
        with pytest.raises(CheckpointError, match=f"step {step}, but the checkpoint is step_2"):
            parse_train_state(edited, step_dir(ckpt, 2))


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_non_finite_weights_are_never_committed(tmp_path, mode):
    model, opt = model_and_optimizer()
    with torch.no_grad():
        model.layers["0"].attention.wq.weight[0, 0] = float("nan")  # type: ignore[index]
    ck = Checkpointer(tmp_path, mode, 0, 1)
    try:
        with pytest.raises(CheckpointSaveError, match=r"layers\.0\.attention\.wq\.weight"):
            ck.save(3, model, opt, train_state(3))
    finally:
        ck.close()
    assert not step_dir(tmp_path, 3).exists() and not list(tmp_path.glob("*.tmp"))
    assert not (tmp_path / "latest").exists()


def test_a_checkpoint_that_records_settings_but_lost_its_checksums_is_damaged(ckpt):
    path = step_dir(ckpt, 2)
    state = json.loads((path / TRAIN_STATE).read_text())
    (path / TRAIN_STATE).write_text(json.dumps(state | {"settings": {}}))
    (path / CHECKSUMS).unlink()
    with pytest.raises(CheckpointError, match=r"checksums\.json is missing"):
        check_loadable(path, Transformer(CFG))


def test_a_checkpoint_from_before_checksums_loads_unverified(ckpt):
    path = step_dir(ckpt, 2)
    (path / CHECKSUMS).unlink()
    assert verify_checkpoint(path) is False
    check_loadable(path, Transformer(CFG))


def test_a_reader_racing_retention_reads_the_newest_again(ckpt, monkeypatch):
    """A run keeping one checkpoint commits step 2 and removes step 1 while a reader
    (eval, export) loads step 1: the reader resolves the newest again and loads step 2, and
    says step 1 was removed, not that anything is broken (it used to say "no checkpoint
    there loads ... delete the broken ones")."""
    import forge.checkpoint.resume as resume

    pending = ckpt.parent / "pending_step_2"
    (ckpt / "step_2").rename(pending)  # not committed yet when the reader resolves
    real = resume.load_checkpoint
    raced: list[str] = []

    def racing(path, *args, **kwargs):
        if path.name == "step_1" and not raced:  # the run commits and retains meanwhile
            raced.append(path.name)
            pending.rename(ckpt / "step_2")
            shutil.rmtree(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(resume, "load_checkpoint", racing)
    said: list[str] = []
    model = Transformer(CFG)
    removed = f"{ckpt / 'step_1'} was removed while it was read (retention of a newer one)"
    assert resume.load_newest_weights(ckpt, None, model, said.append) == ckpt / "step_2"
    assert [line for line in said if "latest" not in line] == [removed]


def test_a_folder_removed_before_it_is_checked_is_a_checkpoint_error_not_a_crash(tmp_path):
    """Retention may remove a step between a reader's listing and its check: the reader's
    fallback takes a ``CheckpointError`` (and says the step was removed), not an ``OSError``."""
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        check_loadable(tmp_path / "step_4", Transformer(CFG))
