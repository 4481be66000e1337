"""The evaluation follower's decisions (``forge.training.evaluation.follow``): which step it
evaluates, records as skipped, waits for or stops at; its record of commits with rewinds; its
records written whole; and the config rule of ``[eval] follow``."""

from __future__ import annotations

import json
import pathlib

import attrs
import pytest

from forge.config import load_config
from forge.config.combinations import follow_problems
from forge.config.loader import ConfigError
from forge.training.evaluation.follow import (
    INCOMPLETE,
    LOSS,
    REMOVED,
    Decision,
    FollowAction,
    FollowView,
    append_record,
    damaged_lines,
    done_pairs,
    follow_line,
    json_lines,
    loss_record,
    next_action,
    recorded_steps,
    repair_tail,
    rewinds_of,
    skipped_record,
    wanted,
)
from forge.training.loop.plan import loop_policy
from tests.conftest import REPO

E, S, W, STOP = FollowAction.EVALUATE, FollowAction.SKIP, FollowAction.WAIT, FollowAction.STOP
BOTH = (LOSS, "task")


def view(committed=(), recorded=(), done=(), final=12) -> FollowView:
    return FollowView(frozenset(committed), frozenset(recorded), frozenset(done), final)


@pytest.mark.parametrize(
    ("case", "seen", "every", "expected"),
    [
        ("nothing committed yet", view(), 1, Decision(W)),
        ("the oldest committed step first", view({4, 2}, {2, 4}), 1, Decision(E, 2, BOTH)),
        (
            "only what a step lacks",
            view({2}, {2}, {(2, LOSS)}),
            1,
            Decision(E, 2, ("task",)),
        ),
        (
            "a done step is passed",
            view({2, 4}, {2, 4}, {(2, LOSS), (2, "task")}),
            1,
            Decision(E, 4, BOTH),
        ),
        ("recorded but gone: skipped", view({4}, {2, 4}), 1, Decision(S, 2, BOTH, REMOVED)),
        (
            "recorded, there but damaged: skipped as such",
            attrs.evolve(view({4}, {2, 4}), incomplete=frozenset({2})),
            1,
            Decision(S, 2, BOTH, INCOMPLETE),
        ),
        ("not a multiple of every", view({3, 6}, {3, 6}), 2, Decision(E, 6, BOTH)),
        ("the last step whatever every is", view({12}, {12}), 5, Decision(E, 12, BOTH)),
        (
            "every wanted step done, the last not committed yet",
            view({4}, {4}, {(4, LOSS), (4, "task")}),
            4,
            Decision(W),
        ),
        (
            "the last step done: stop",
            view({12}, {12}, {(12, LOSS), (12, "task")}),
            4,
            Decision(STOP),
        ),
        (
            "the last step skipped (removed) counts as done",
            view(set(), {12}, {(12, LOSS), (12, "task")}),
            1,
            Decision(STOP),
        ),
        ("committed but not yet in the record", view({6}, ()), 1, Decision(E, 6, BOTH)),
        ("step 0 (a model-only start) is not evaluated", view({0}, {0}), 1, Decision(W)),
        (
            "the last step done but a trainer runs (a resume may go further): wait",
            attrs.evolve(view({12}, {12}, {(12, LOSS), (12, "task")}), trainer_running=True),
            4,
            Decision(W),
        ),
    ],
)
def test_next_action(case, seen, every, expected):
    assert next_action(seen, BOTH, every) == expected, case


@pytest.mark.parametrize(
    ("step", "every", "final", "expected"),
    [(4, 2, 12, True), (5, 2, 12, False), (12, 5, 12, True), (0, 1, 12, False), (7, 1, 12, True)],
)
def test_wanted_steps(step, every, final, expected):
    assert wanted(step, every, final) is expected


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([{"step": 2}, {"step": 4}], {2, 4}),
        ([{"step": 2}, {"step": 4}, {"step": 6}, {"step": 2, "rewound_from": 6}], {2}),
        ([{"step": 2}, {"step": 4}, {"step": 2, "rewound_from": 4}, {"step": 4}], {2, 4}),
        ([{"step": "2"}, {"time": 1.0}, {"step": 3}], {3}),
    ],
)
def test_recorded_steps_take_back_what_a_rewind_undid(entries, expected):
    assert recorded_steps(entries) == frozenset(expected)


def test_damaged_lines_are_counted_and_passed_over(tmp_path):
    path = tmp_path / "eval_follow.jsonl"
    path.write_bytes(b'{"step": 2, "what": "loss"}\n\xff\xfe\n[1]\n\n{"step": 4, "what": "loss"}\n')
    assert damaged_lines(path) == 2
    assert done_pairs(json_lines(path)) == {(2, LOSS), (4, LOSS)}
    assert damaged_lines(tmp_path / "absent") == 0


def test_records_are_whole_lines_and_a_torn_tail_is_cut(tmp_path):
    path = tmp_path / "eval_follow.jsonl"
    append_record(path, loss_record(2, 1.5, 64, "ck/step_2"))
    with path.open("ab") as f:  # a kill in the middle of the next write
        f.write(b'{"step": 4, "what": "lo')
    assert done_pairs(json_lines(path)) == {(2, LOSS)}
    repair_tail(path)
    append_record(path, skipped_record(4, LOSS, REMOVED))
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]
    assert done_pairs(json_lines(path)) == {(2, LOSS), (4, LOSS)}


@pytest.mark.parametrize(
    ("loss", "expected_loss", "perplexity"),
    [(1.0, 1.0, pytest.approx(2.718281828)), (float("nan"), None, None), (800.0, 800.0, None)],
)
def test_a_non_finite_loss_is_recorded_as_null(tmp_path, loss, expected_loss, perplexity):
    path = tmp_path / "r.jsonl"
    append_record(path, loss_record(2, loss, 8, "x"))
    record = json.loads(path.read_text())
    assert record["eval/loss"] == expected_loss and record["eval/perplexity"] == perplexity


TOML = """
[model]
dim = 32
n_layers = 1
n_heads = 2
vocab_size = 259
max_seq_len = 32
[train]
max_steps = 200
seq_len = 32
[data]
path = "data"
[eval]
interval = {interval}
follow = {follow}
[checkpoint]
interval = {ck}
enabled = {enabled}
"""


def config(tmp_path, interval=4, follow="true", ck=2, enabled="true"):
    path = tmp_path / "c.toml"
    path.write_text(TOML.format(interval=interval, follow=follow, ck=ck, enabled=enabled))
    return load_config([str(path)]).config


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({}, None),
        ({"follow": "false", "interval": 3}, None),
        ({"interval": 0}, None),
        ({"interval": 3}, "checkpoint.interval=2 does not save them"),
        ({"enabled": "false"}, "checkpoint.enabled is false"),
    ],
)
def test_follow_needs_the_steps_it_evaluates_saved(tmp_path, kwargs, problem):
    if problem is None:
        assert follow_problems(config(tmp_path, **kwargs)) == []
        return
    with pytest.raises(ConfigError) as err:
        config(tmp_path, **kwargs)
    assert "eval.follow" in str(err.value) and problem in str(err.value)


def test_a_followed_run_does_not_evaluate_in_the_loop(tmp_path):
    assert loop_policy(config(tmp_path, follow="true")).eval_interval == 0
    assert loop_policy(config(tmp_path, follow="false")).eval_interval == 4


@pytest.mark.parametrize(
    ("records", "rewinds", "expected"),
    [
        ([{"step": 6, "what": LOSS, "time": 10.0}], [], {(6, LOSS)}),
        ([{"step": 6, "what": LOSS, "time": 10.0}], [(4, 20.0)], set()),  # rewound past it
        ([{"step": 6, "what": LOSS, "time": 30.0}], [(4, 20.0)], {(6, LOSS)}),  # its new ckpt
        ([{"step": 4, "what": LOSS, "time": 10.0}], [(4, 20.0)], {(4, LOSS)}),  # kept step
        ([{"step": 6, "what": LOSS}], [(4, 20.0)], {(6, LOSS)}),  # no time: cannot tell
        ([{"step": "6", "what": LOSS}, {"step": 2}], [], set()),  # damaged lines
    ],
)
def test_a_rewind_retires_the_records_of_the_steps_it_undid(records, rewinds, expected):
    assert done_pairs(records, rewinds) == frozenset(expected)


def test_rewinds_come_from_the_record_of_commits():
    entries = [{"step": 4, "time": 1.0}, {"step": 2, "time": 5.0, "rewound_from": 4}, {"step": 6}]
    assert rewinds_of(entries) == [(2, 5.0)]


@pytest.mark.parametrize(
    ("follow", "interval", "expected"),
    [
        (False, 4, None),
        (True, 4, "checkpoints of every 4 steps: python scripts/eval_follow.py runs/x"),
        (True, 0, "checkpoints of every committed step: python scripts/eval_follow.py runs/x"),
    ],
)
def test_a_followed_run_says_where_its_evaluation_happens(follow, interval, expected):
    line = follow_line(follow, interval, pathlib.Path("runs/x"))
    assert line == expected or (
        expected is not None and line is not None and line.endswith(expected)
    )


@pytest.mark.parametrize(
    "folder,retiring,is_damaged",
    [
        (True, False, True),  # there without its commit marker, no one removing it
        (True, True, False),  # retention is taking it apart: removed, not damaged
        (False, True, False),  # gone, the mark not yet taken back
        (False, False, False),  # gone
    ],
)
def test_a_committed_step_being_removed_by_retention_is_not_called_damaged(
    tmp_path, folder, retiring, is_damaged
):
    from forge.checkpoint.pins import RETIRING, marker_path, write_mark
    from forge.training.evaluation.follower import damaged

    if folder:
        (tmp_path / "step_4").mkdir()
        (tmp_path / "step_4" / "__0_0.distcp").write_bytes(b"x")  # a shard, no .metadata
    if retiring:
        write_mark(marker_path(tmp_path, 4, RETIRING), b"")
    assert damaged(tmp_path, 4) is is_damaged


def test_a_commit_landing_during_a_look_is_seen_complete_never_as_damage(tmp_path, monkeypatch):
    """The trainer renames a finished save into place, then records its commit: a look that
    listed the checkpoints before reading the record would find the step recorded, its folder
    there, and not in its list of complete ones — a good checkpoint skipped as damaged."""
    from forge.training.evaluation import follower
    from forge.training.records.run_records import record_commit

    root = tmp_path / "checkpoints"
    root.mkdir()
    config = load_config([str(REPO / "configs" / "train" / "debug.toml")]).config

    def commit(step: int) -> None:
        folder = root / f"step_{step}"
        folder.mkdir()
        for name in (".metadata", "train_state.json"):
            (folder / name).write_bytes(b"{}")
        record_commit(tmp_path, step)

    commit(4)
    read = follower.json_lines

    def committing_meanwhile(path: pathlib.Path) -> list[dict]:
        if path.name == "checkpoints.jsonl" and not (root / "step_5").exists():
            commit(5)  # the trainer, exactly as the record of commits is read
        return read(path)

    monkeypatch.setattr(follower, "json_lines", committing_meanwhile)
    view = follower.look(tmp_path, root, config, [])
    assert view.incomplete == frozenset()
    assert next_action(view, (LOSS,), 1) == Decision(FollowAction.EVALUATE, 4, (LOSS,))
    assert view.committed == view.recorded == frozenset({4, 5})
