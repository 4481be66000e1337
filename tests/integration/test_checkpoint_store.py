"""The DCP store: exact round trip, atomic layout, latest, retention, clear errors."""

from __future__ import annotations

import os
import pathlib
import random

import pytest
import torch

from forge.checkpoint.checkpointer import save_checkpoint
from forge.checkpoint.policy import SaveSchedule
from forge.checkpoint.resume import ResumeSource, resolve_resume
from forge.checkpoint.store import (
    TRAIN_STATE,
    CheckpointError,
    apply_retention,
    is_complete,
    latest_step,
    load_checkpoint,
    step_dir,
)
from forge.config import ModelConfig, OptimizerConfig
from forge.model.transformer import Transformer
from forge.optim import build_optimizer

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def trained(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    model = Transformer(cfg)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
    model(torch.randint(0, 259, (2, 16))).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_round_trip_is_exact_for_model_optimizer_and_rng(tmp_path):
    model, opt = trained(0)
    torch.manual_seed(123)
    random.seed(5)
    save_checkpoint(tmp_path, 7, model, opt, {"step": 7, "note": "x"})
    expected_torch, expected_py = torch.rand(3), random.random()
    fresh, fresh_opt = trained(1)
    state = load_checkpoint(step_dir(tmp_path, 7), fresh, fresh_opt)
    assert state == {"step": 7, "note": "x"}
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    sa, sb = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
        assert torch.equal(torch.as_tensor(sa[k]["step"]), torch.as_tensor(sb[k]["step"]))
    assert torch.equal(torch.rand(3), expected_torch)
    assert random.random() == expected_py


def test_layout_and_latest(tmp_path):
    model, opt = trained()
    save_checkpoint(tmp_path, 3, model, opt, {"step": 3})
    save_checkpoint(tmp_path, 6, model, opt, {"step": 6})
    assert os.readlink(tmp_path / "latest") == "step_6"
    assert latest_step(tmp_path) == 6
    assert is_complete(tmp_path / "step_3") and is_complete(tmp_path / "step_6")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_3", "step_6"]  # no .tmp left behind
    assert (tmp_path / "step_6" / "rng_rank0.pt").is_file()


def test_train_state_is_json_and_rng_loads_without_pickle(tmp_path):
    model, opt = trained()
    path = save_checkpoint(tmp_path, 1, model, opt, {"step": 1})
    import json

    assert json.loads((path / TRAIN_STATE).read_text()) == {"step": 1}
    torch.load(path / "rng_rank0.pt", weights_only=True)  # raises if it needed pickle


def test_retention_keeps_latest_and_milestones(tmp_path):
    model, opt = trained()
    for step in (1, 2, 4, 10, 20, 30):
        save_checkpoint(tmp_path, step, model, opt, {"step": step})
    deleted = apply_retention(tmp_path, 2, SaveSchedule(10, window_start=0, window_stop=4))
    assert deleted == [10]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_1",
        "step_2",
        "step_20",
        "step_30",
        "step_4",
    ]


def test_shape_mismatch_is_one_clear_line(tmp_path):
    model, opt = trained()
    save_checkpoint(tmp_path, 1, model, opt, {"step": 1})
    other, other_opt = trained(cfg=ModelConfig(dim=64, n_layers=2, n_heads=4, max_seq_len=16))
    with pytest.raises(CheckpointError, match=r"'tok_embeddings.weight' has shape \[259, 32\]"):
        load_checkpoint(tmp_path / "step_1", other, other_opt)


def test_loading_an_incomplete_checkpoint_is_refused(tmp_path):
    model, opt = trained()
    path = save_checkpoint(tmp_path, 1, model, opt, {"step": 1})
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(path, model, opt)


def test_model_only_load_leaves_the_optimizer_alone(tmp_path):
    model, opt = trained(0)
    save_checkpoint(tmp_path, 1, model, opt, {"step": 1})
    fresh = Transformer(CFG)
    load_checkpoint(tmp_path / "step_1", fresh, None, restore_rng_state=False)
    assert torch.equal(fresh.output.weight, model.output.weight)


# ---- the resume resolver (files only; no tensors needed) ----


def fake_ckpt(root: pathlib.Path, step: int, complete: bool = True) -> pathlib.Path:
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    if complete:
        (path / ".metadata").write_bytes(b"")
        (path / TRAIN_STATE).write_text("{}")
    return path


def point_latest(root: pathlib.Path, step: int) -> None:
    (root / "latest").symlink_to(f"step_{step}")


# (case, complete steps, incomplete steps, latest, load_path?, source, chosen step, skipped)
RESOLVE = [
    ("empty dir: fresh", [], [], None, False, ResumeSource.FRESH, None, []),
    ("latest names the newest", [2, 4], [], 4, False, ResumeSource.CHECKPOINT_DIR, 4, []),
    (
        "latest older: the newest complete wins",
        [2, 4],
        [],
        2,
        False,
        ResumeSource.CHECKPOINT_DIR,
        4,
        [],
    ),
    ("no latest: newest complete", [2, 4], [], None, False, ResumeSource.CHECKPOINT_DIR, 4, []),
    ("incomplete newest is skipped", [2, 4], [6], 4, False, ResumeSource.CHECKPOINT_DIR, 4, [6]),
    ("latest incomplete: newest complete", [2], [4], 4, False, ResumeSource.CHECKPOINT_DIR, 2, [4]),
    ("checkpoint dir beats load_path", [2], [], 2, True, ResumeSource.CHECKPOINT_DIR, 2, []),
    ("load_path when dir is empty", [], [], None, True, ResumeSource.LOAD_PATH, 9, []),
]


@pytest.mark.parametrize(
    "complete,incomplete,latest,use_load,source,chosen,skipped",
    [r[1:] for r in RESOLVE],
    ids=[r[0] for r in RESOLVE],
)
def test_resume_resolver(tmp_path, complete, incomplete, latest, use_load, source, chosen, skipped):
    root = tmp_path / "ckpt"
    root.mkdir()
    for s in complete:
        fake_ckpt(root, s)
    for s in incomplete:
        fake_ckpt(root, s, complete=False)
    if latest is not None:
        point_latest(root, latest)
    load = None
    if use_load:
        load = fake_ckpt(tmp_path / "init", 9)
    plan = resolve_resume(root, load)
    assert plan.source is source
    assert plan.path == (
        None
        if chosen is None
        else (load if source is ResumeSource.LOAD_PATH else root / f"step_{chosen}")
    )
    assert [p.name for p in plan.skipped] == [f"step_{s}" for s in skipped]


# (case, what ``latest`` is a link to, the reason said): complete step_2 and step_4 exist
LATEST_LINKS = [
    ("a step that does not exist", "step_9", "points at step_9, which does not exist"),
    ("an incomplete step", "step_6", "points at step_6, which is incomplete"),
    ("itself", "latest", "a loop of links"),
    ("a loop through another link", "other", "a loop of links"),
    ("another run's checkpoint", "../../run_b/checkpoints/step_4", "outside this checkpoint directory"),
    ("an absolute path", "/tmp/elsewhere/step_4", "outside this checkpoint directory"),
    ("no step folder", "notes.txt", "not a step_<N> folder"),
]  # fmt: skip


@pytest.mark.parametrize(("target", "reason"), [c[1:] for c in LATEST_LINKS],
                         ids=[c[0] for c in LATEST_LINKS])  # fmt: skip
def test_a_latest_that_names_no_checkpoint_of_the_run_is_passed_over_and_said_once(
    tmp_path, target, reason
):
    root = tmp_path / "ckpt"
    root.mkdir()
    for step in (2, 4):
        fake_ckpt(root, step)
    fake_ckpt(root, 6, complete=False)
    (root / "other").symlink_to("latest")
    (root / "latest").symlink_to(target)
    plan = resolve_resume(root, None)
    assert plan.path == root / "step_4"
    assert plan.latest_note is not None and reason in plan.latest_note
    assert "resuming from step_4, the newest complete checkpoint, instead" in plan.latest_note


def test_a_latest_that_names_the_newest_checkpoint_says_nothing(tmp_path):
    for step in (2, 4):
        fake_ckpt(tmp_path, step)
    point_latest(tmp_path, 4)
    assert resolve_resume(tmp_path, None).latest_note is None
    assert resolve_resume(tmp_path / "none", None).latest_note is None


def test_a_latest_moved_back_is_named_and_the_newer_checkpoint_kept(tmp_path):
    """A commit cut between the rename and the pointer, or a pointer moved back by hand: the
    newer committed step is resumed (never overwritten later), and the start says so."""
    for step in (2, 4):
        fake_ckpt(tmp_path, step)
    point_latest(tmp_path, 2)
    plan = resolve_resume(tmp_path, None)
    assert plan.path == tmp_path / "step_4"
    assert plan.latest_note is not None
    assert "names step_2, but step_4 is newer and complete: resuming from step_4" in (
        plan.latest_note
    )
    assert "--checkpoint.allow_rewind=true" in plan.latest_note


# (case, what is put in the checkpoint directory beside a complete step_4, the refusal)
IN_THE_WAY = [
    ("a file at a step path", {"step_12": "file"}, r"step_12: not a checkpoint folder, and in the way"),
    ("a link to a file at a step path", {"notes": "file", "step_12": "link to notes"}, r"step_12: not a checkpoint folder, and in the way"),
    ("a folder at latest", {"latest": "folder"}, r"latest: a folder where each commit of this run writes its link"),
]  # fmt: skip


@pytest.mark.parametrize(
    "entries,refusal", [w[1:] for w in IN_THE_WAY], ids=[w[0] for w in IN_THE_WAY]
)
def test_a_path_a_save_needs_that_is_in_its_way_is_refused_at_start(tmp_path, entries, refusal):
    """A file at ``step_12`` used to read as an incomplete checkpoint, a folder at
    ``latest`` as no link: the run trained to its first save, which failed, every launch
    again."""
    fake_ckpt(tmp_path, 4)
    for name, kind in entries.items():
        if kind == "file":
            (tmp_path / name).write_text("notes")
        elif kind == "folder":
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).symlink_to(kind.removeprefix("link to "))
    with pytest.raises(CheckpointError, match=refusal):
        resolve_resume(tmp_path, None)


def test_only_incomplete_checkpoints_is_a_clear_error(tmp_path):
    fake_ckpt(tmp_path, 3, complete=False)
    with pytest.raises(CheckpointError, match="none is complete"):
        resolve_resume(tmp_path, None)


def test_load_path_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint\.load_path"):
        resolve_resume(tmp_path / "ckpt", tmp_path / "nothing")


def test_load_path_may_name_a_checkpoint_directory(tmp_path):
    fake_ckpt(tmp_path / "other", 5)
    fake_ckpt(tmp_path / "other", 8)
    plan = resolve_resume(tmp_path / "ckpt", tmp_path / "other")
    assert plan.path == tmp_path / "other" / "step_8"


def test_retention_never_deletes_a_complete_checkpoint_for_an_incomplete_one(tmp_path):
    """keep_last_n=2 with complete step_4 and step_8 and a damaged (incomplete) step_20."""
    from forge.checkpoint.policy import SaveSchedule
    from forge.checkpoint.store import TRAIN_STATE, apply_retention

    for step in (4, 8):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / ".metadata").write_bytes(b"m")
        (tmp_path / f"step_{step}" / TRAIN_STATE).write_text("{}")
    (tmp_path / "step_20").mkdir()
    (tmp_path / "step_20" / TRAIN_STATE).write_text("{}")  # no .metadata: incomplete
    (tmp_path / "step_2").mkdir()  # incomplete and older than every complete one
    assert apply_retention(tmp_path, 2, SaveSchedule(interval=4)) == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_20", "step_4", "step_8"]
