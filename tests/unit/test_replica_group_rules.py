"""Replica groups' decisions (``[fault_tolerance]``): which micro-batches of a step each group
reads, what a step's record says of them, the loop state a heal continues from, a peer's
state refused when its layout differs, and every bad input as one line, exit 2, nothing
written."""

from __future__ import annotations

import functools
import socket
import sys

import attrs
import pytest
import torch

from forge.config import load_config
from forge.config.fault_tolerance import FaultToleranceConfig
from forge.data.batch import Batch
from forge.data.row_order import share_of
from forge.model.chunked_loss import PLAIN_LOSS
from forge.resilience.replica_groups import Quorum, short_cause
from forge.training.loop.loop import healed_state
from forge.training.loop.step_logger import replica_record, replicas_since
from forge.training.steps.replicas import (
    LayoutMismatchError,
    StepReplicas,
    locals_of,
    quorum_problem,
    replicated_step,
)
from forge.types import LoopState, ReplicaStep, StepResult
from tests.e2e.test_train_script import TRAIN, nothing_written


@pytest.mark.parametrize(
    "slots,participants,shares",
    [
        (2, 2, [range(0, 1), range(1, 2)]),  # two groups, one micro-batch each
        (2, 1, [range(0, 2)]),  # one left: it takes the whole step
        (4, 2, [range(0, 2), range(2, 4)]),  # grad_accum_steps 2 each
        (3, 2, [range(0, 2), range(2, 3)]),  # three groups' step, one lost: uneven
        (6, 4, [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]),
        (3, 3, [range(0, 1), range(1, 2), range(2, 3)]),
    ],
)
def test_the_shares_of_the_groups_taking_part_are_the_steps_micro_batches_in_order(
    slots, participants, shares
):
    got = [share_of(slots, participants, rank) for rank in range(participants)]
    assert got == shares
    assert [i for share in got for i in share] == list(range(slots))


@pytest.mark.parametrize("rank,participants", [(2, 2), (-1, 2), (0, 0)])
def test_a_group_outside_the_quorum_has_no_share(rank, participants):
    with pytest.raises(ValueError, match="not one of"):
        share_of(4, participants, rank)


@pytest.mark.parametrize(
    "slots,participants,unit,shares",
    [
        (4, 2, 2, [range(0, 2), range(2, 4)]),  # two pipelined groups, accum 2 each
        (4, 1, 2, [range(0, 4)]),  # one left: two runs of its schedule
        (6, 2, 2, [range(0, 4), range(4, 6)]),  # three groups' step, one lost: whole units
        (9, 2, 3, [range(0, 6), range(6, 9)]),
        (6, 3, 2, [range(0, 2), range(2, 4), range(4, 6)]),
    ],
)
def test_a_pipelined_groups_share_is_whole_runs_of_its_schedule(slots, participants, unit, shares):
    got = [share_of(slots, participants, rank, unit) for rank in range(participants)]
    assert got == shares
    assert all(len(share) % unit == 0 for share in got)
    assert [i for share in got for i in share] == list(range(slots))


@pytest.mark.parametrize("slots,unit", [(5, 2), (4, 0)])
def test_a_step_that_is_not_whole_units_has_no_share(slots, unit):
    with pytest.raises(ValueError, match="units of"):
        share_of(slots, 1, 0, unit)


@pytest.mark.parametrize(
    "replicas,record",
    [
        (None, {}),
        (ReplicaStep(2), {"ft/participants": 2, "ft/failed_attempts": 0}),
        (ReplicaStep(1, failed_attempts=1), {"ft/participants": 1, "ft/failed_attempts": 1}),
        (
            ReplicaStep(2, rebase=LoopState(step=26), heal_s=0.25),
            {"ft/participants": 2, "ft/failed_attempts": 0, "ft/heal_s": 0.25},
        ),
        (  # healed at set-up: the loop started from the peer's state
            ReplicaStep(2, heal_s=0.5),
            {"ft/participants": 2, "ft/failed_attempts": 0, "ft/heal_s": 0.5},
        ),
    ],
)
def test_a_steps_record_says_who_took_part_what_failed_and_a_heal(replicas, record):
    assert replica_record(replicas) == record


@pytest.mark.parametrize(
    "replicas,expected",
    [
        (None, None),
        (ReplicaStep(2), None),
        (ReplicaStep(2, rebase=LoopState(step=26, tokens_seen=7)), LoopState(26, 7)),
    ],
)
def test_a_step_that_healed_continues_from_the_peers_loop_state(replicas, expected):
    result = StepResult(loss=1.0, grad_norm=1.0, tokens=1, lr=1.0, replicas=replicas)
    assert healed_state(result) == expected


def test_the_global_batch_a_checkpoint_records_counts_every_group(tiny_config):
    from forge.training.records.resume_rules import GLOBAL_BATCH
    from forge.training.records.run_record import run_identity

    plain = load_config([str(tiny_config), "--train.grad_accum_steps=2"]).config
    groups = load_config(
        [str(tiny_config), "--fault_tolerance.enabled=true", "--fault_tolerance.groups=2"]
    ).config
    assert run_identity(plain, 1)[GLOBAL_BATCH] == run_identity(groups, 1)[GLOBAL_BATCH] == 8


ON = functools.partial(FaultToleranceConfig, enabled=True)


@pytest.mark.parametrize(
    "cfg,keys",
    [
        (ON(group=2, groups=2), ["fault_tolerance.group"]),
        (ON(group=-1, groups=2), ["fault_tolerance.group"]),
        (ON(groups=0), ["fault_tolerance.groups"]),
        (ON(groups=2, min_groups=3), ["fault_tolerance.min_groups"]),
        (ON(lighthouse="vm:29510"), ["fault_tolerance.lighthouse"]),
        (ON(timeout_s=0), ["fault_tolerance.timeout_s"]),
        (ON(timeout_s=0.001), ["fault_tolerance.timeout_s"]),  # below 1 s
        (ON(quorum_timeout_s=float("nan")), ["fault_tolerance.quorum_timeout_s"]),
        (ON(groups=2, group=1, lighthouse="http://vm:29510"), []),
    ],
)
def test_fault_tolerance_values_out_of_range_name_their_key(cfg, keys):
    assert [key for key, _ in cfg.problems()] == keys


@pytest.mark.parametrize(
    "pp,workers,check,keys",
    [
        (1, 0, 0, []),
        (2, 0, 0, []),  # a pipeline runs its share a schedule's micro-batches at a time
        (1, 2, 0, ["data.num_workers"]),  # a share is read once its quorum is known
        (1, 0, 10, ["train.float8_check"]),  # a group would judge its share alone
        (2, 1, 10, ["data.num_workers", "train.float8_check"]),
    ],
)
def test_what_replica_groups_do_not_run_with_yet_is_refused_by_name(
    tiny_config, pp, workers, check, keys
):
    from forge.config.combinations import fault_tolerance_problems

    base = load_config([str(tiny_config)]).config
    config = attrs.evolve(
        base,
        distributed=attrs.evolve(base.distributed, pp=pp),
        data=attrs.evolve(base.data, num_workers=workers),
        train=attrs.evolve(base.train, float8_check=check),
    )
    on = attrs.evolve(config, fault_tolerance=FaultToleranceConfig(enabled=True))
    assert [key for key, _ in fault_tolerance_problems(on)] == keys
    assert fault_tolerance_problems(config) == []  # off: nothing to refuse


class FakeGroups:
    """The manager's side a heal reads: the fingerprint and ``register``."""

    fingerprint = 7

    def register(self, send, receive) -> None:
        self.send, self.receive = send, receive


@attrs.define
class Holder:
    """The two fields of a ``ModelContext`` a heal touches."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def test_a_peers_state_with_another_layout_is_refused_before_anything_changes():
    model = torch.nn.Linear(2, 2)
    groups = FakeGroups()
    holder = Holder(model, torch.optim.AdamW(model.parameters()))
    replicas = StepReplicas(groups, holder, None, 2)  # type: ignore[arg-type]
    before = model.weight.detach().clone()
    payload = {"fingerprint": 8, "model": {k: v * 0 for k, v in model.state_dict().items()}}
    with pytest.raises(LayoutMismatchError, match="launch it with theirs"):
        groups.receive(payload)
    assert torch.equal(model.weight, before)
    assert replicas.rebase is None


def test_a_heal_sends_local_tensors():
    tree = {"a": torch.ones(2), "b": [torch.zeros(1), 3], "c": {"d": "x"}}
    assert locals_of(tree)["b"][1] == 3 and torch.equal(locals_of(tree)["a"], torch.ones(2))


@pytest.fixture
def listening():
    """An address where a connection opens (the lighthouse's check asks no more)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


BAD_INPUT = [
    (
        "group out of range",
        ["--fault_tolerance.groups=2", "--fault_tolerance.group=2"],
        "fault_tolerance.group: must be in [0, fault_tolerance.groups=2), got 2",
    ),
    (
        "lighthouse not answering",
        ["--fault_tolerance.lighthouse=http://127.0.0.1:1"],
        "fault_tolerance.lighthouse: nothing answers at http://127.0.0.1:1",
    ),
    (
        "no lighthouse",
        [],
        "fault_tolerance.lighthouse: no lighthouse address (nor $TORCHFT_LIGHTHOUSE)",
    ),
    (
        "loader workers",
        ["--fault_tolerance.lighthouse={listening}", "--data.num_workers=2"],
        "data.num_workers: must be 0 with fault_tolerance.enabled",
    ),
]


@pytest.mark.parametrize("extra,text", [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT])
def test_bad_fault_tolerance_input_is_one_line_exit_2_and_nothing_on_disk(
    tiny_config, capsys, monkeypatch, listening, extra, text
):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    extra = [arg.format(listening=listening) for arg in extra]
    args = [str(tiny_config), "--fault_tolerance.enabled=true", *extra]
    assert TRAIN.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(text in line for line in err), err
    assert len(err) == 1, err
    assert nothing_written(tiny_config)


def test_without_torchft_the_extra_is_named(tiny_config, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    args = [str(tiny_config), "--fault_tolerance.enabled=true"]
    assert TRAIN.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'forge[ft]'" in err[0], err
    assert nothing_written(tiny_config)


@pytest.mark.parametrize(
    "mine,others,agreed",
    [
        (7, [7], True),
        (7, [7, 7], True),
        (7, [], True),  # alone
        (7, [8], False),
        (7, [6, 8], False),  # the same sum, another sum of squares
        ((1 << 20) - 1, [(1 << 20) - 1] * 3, True),  # the largest fingerprint sums exactly
    ],
)
def test_groups_agree_on_a_layout_only_when_every_fingerprint_is_the_same(mine, others, agreed):
    from forge.resilience.replica_groups import ReplicaGroups

    groups = ReplicaGroups.__new__(ReplicaGroups)  # the arithmetic needs no manager
    groups.settle(mine)  # what the steps compare, once set-up has settled it
    sums = groups.layout_terms(torch.device("cpu"))
    for f in others:
        sums += torch.tensor([1.0, f, f * f], dtype=torch.float64)
    assert groups.agreed_layout(sums) is agreed


@pytest.mark.parametrize(
    "participants,groups,min_groups,reason",
    [
        (2, 2, 1, None),
        (1, 2, 1, None),  # one left: it takes the whole step
        (1, 2, 2, "1 of fault_tolerance.min_groups=2 groups take part"),
        (3, 2, 1, "more than fault_tolerance.groups=2: two launches share a group index"),
        (2, 1, 1, "more than fault_tolerance.groups=1"),
    ],
)
def test_a_step_runs_only_in_a_quorum_of_between_min_groups_and_groups(
    participants, groups, min_groups, reason
):
    problem = quorum_problem(participants, groups, min_groups)
    assert problem is None if reason is None else reason in problem


class WaitingGroups(FakeGroups):
    """A quorum of one group, always (its peer gone), under ``min_groups = 2``."""

    cfg = FaultToleranceConfig(
        enabled=True, groups=2, min_groups=2, quorum_timeout_s=1.0, heartbeat_ms=10
    )

    def __init__(self) -> None:
        self.quorums = 0

    def quorum(self) -> Quorum:
        self.quorums += 1
        return Quorum(participants=1, rank=0)


def never_called(batches, state):
    raise AssertionError("a step ran in a quorum it may not run in")


@pytest.mark.parametrize("stop", [False, True])
def test_a_step_waiting_for_groups_ends_at_the_quorum_timeout_or_a_signal_saying_so_once(stop):
    groups = WaitingGroups()
    model = torch.nn.Linear(2, 2)
    replicas = StepReplicas(groups, Holder(model, torch.optim.AdamW(model.parameters())), None, 2)  # type: ignore[arg-type]
    replicas.stop_requested = lambda: stop
    said: list[str] = []
    result = replicated_step(never_called, replicas, said.append)(None, LoopState(step=8))  # type: ignore[arg-type]
    assert result.collective_failed  # the run ends HEALTH_FAILURE: the last checkpoint stands
    waits = [line for line in said if "min_groups=2" in line and line.startswith("step 9")]
    assert len(waits) == 1, said  # once, however many quorums it asked for
    assert groups.quorums == 1 if stop else groups.quorums > 2
    last = said[-1]
    assert ("while waiting for replica groups" in last) if stop else ("quorum_timeout_s=1" in last)


@pytest.mark.parametrize(
    "error,cause",
    [
        (
            TimeoutError(
                'status: Cancelled, message: "Timeout expired", details: [], metadata: {}'
            ),
            'Cancelled, message: "Timeout expired"',
        ),
        (RuntimeError("x" * 300), "x" * 117 + "..."),
    ],
)
def test_torchfts_errors_are_cut_to_their_cause(error, cause):
    assert short_cause(error) == cause


@pytest.mark.parametrize(
    "on_nonfinite,on_spike,keys",
    [
        ("skip", "warn", []),
        ("rollback", "warn", ["resilience.on_nonfinite"]),  # a healed group's snapshot differs
        ("skip", "rollback", ["resilience.on_spike"]),
    ],
)
def test_rollback_is_refused_with_replica_groups(tiny_config, on_nonfinite, on_spike, keys):
    from forge.config.combinations import fault_tolerance_problems
    from forge.config.resilience import NonFinitePolicy, SpikePolicy

    base = load_config([str(tiny_config)]).config
    resilience = attrs.evolve(
        base.resilience, on_nonfinite=NonFinitePolicy(on_nonfinite), on_spike=SpikePolicy(on_spike)
    )
    on = attrs.evolve(
        base, resilience=resilience, fault_tolerance=FaultToleranceConfig(enabled=True)
    )
    assert [key for key, _ in fault_tolerance_problems(on)] == keys


class RecordingSchedule:
    """A pipeline schedule that records the first stage's input of each run."""

    def __init__(self) -> None:
        self.runs: list[torch.Tensor] = []

    def step(self, *args: torch.Tensor, **_kwargs: object) -> None:
        self.runs.append(args[0])


@pytest.mark.parametrize("share,runs", [(2, 1), (4, 2), (6, 3)])
def test_a_pipelined_groups_share_runs_its_schedule_a_schedules_micro_batches_at_a_time(
    share, runs
):
    from forge.training.context import PipelineContext
    from forge.training.steps.pipeline import Pass, run_stage

    schedule = RecordingSchedule()
    pipeline = PipelineContext(schedule, None, (0,), 2, 2)  # type: ignore[arg-type]
    batches = [Batch(torch.full((1, 3), i), torch.full((1, 3), i)) for i in range(share)]
    run_stage(pipeline, batches, PLAIN_LOSS, Pass.TRAIN)
    assert len(schedule.runs) == runs
    # every micro-batch once, in the step's order, two per run of the schedule
    assert torch.cat(schedule.runs)[:, 0].tolist() == list(range(share))
    with pytest.raises(ValueError, match="3 micro-batches do not run"):
        run_stage(pipeline, batches[:1] * 3, PLAIN_LOSS, Pass.TRAIN)


@pytest.mark.parametrize(
    "steps,logged",
    [
        ([ReplicaStep(2), ReplicaStep(2)], ReplicaStep(2)),
        # one group alone between two logs of two: the log says so
        ([ReplicaStep(2), ReplicaStep(1, failed_attempts=1), ReplicaStep(2)], ReplicaStep(1, 1)),
        ([ReplicaStep(1), ReplicaStep(2, heal_s=0.25), ReplicaStep(2, heal_s=0.5)],
         ReplicaStep(1, 0, heal_s=0.75)),
        ([None, ReplicaStep(3, failed_attempts=2)], ReplicaStep(3, 2)),
        ([None, None], None),
    ],
)  # fmt: skip
def test_a_log_covers_every_replica_step_since_the_last(steps, logged):
    since = None
    for step in steps:
        since = replicas_since(since, step)
    assert since == logged


class Kept:
    """A metrics sink that keeps the records."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        pass


def test_a_logger_every_two_steps_reports_the_step_one_group_ran_alone_between_its_logs():
    from types import SimpleNamespace

    from forge.config.sections import JobConfig
    from forge.training.loop.step_logger import StepLogger

    dist = SimpleNamespace(device=torch.device("cpu"), world_size=1, rank=0, token_slices=1,
                           is_main=True)  # fmt: skip
    loader = SimpleNamespace(state_dict=lambda: {"rows": 0, "digest": "0"})
    data = SimpleNamespace(train_loader=loader, source_names=())
    sink = Kept()
    logger = StepLogger(SimpleNamespace(config=JobConfig()), dist, data, [sink])  # type: ignore[arg-type]
    # the unlogged steps (1 and 3) are the ones that went otherwise
    steps = [ReplicaStep(1, failed_attempts=1), ReplicaStep(2), ReplicaStep(2, heal_s=0.5),
             ReplicaStep(2)]  # fmt: skip
    for step, replicas in enumerate(steps, start=1):
        result = StepResult(loss=1.0, grad_norm=1.0, tokens=8, lr=0.1, replicas=replicas)
        if step % 2 == 0:  # the loop logs every second step, then ends each step
            logger.log(LoopState(step=step), result)
        logger.step_end(result)
    first, second = ({k: v for k, v in r.items() if k.startswith("ft/")} for r in sink.records)
    assert first == {"ft/participants": 1, "ft/failed_attempts": 1}
    assert second == {"ft/participants": 2, "ft/failed_attempts": 0, "ft/heal_s": 0.5}


# (case, the section, the keys a launch refuses)
UNREAD = [
    ("off, nothing set", FaultToleranceConfig(), []),
    ("on: every key read", ON(groups=2, group=1, lighthouse="http://vm:29510"), []),
    (
        "off, a group's keys set: each named (the run would train as a whole)",
        FaultToleranceConfig(groups=2, group=1, lighthouse="http://vm:29510"),
        ["fault_tolerance.lighthouse", "fault_tolerance.group", "fault_tolerance.groups"],
    ),
]


@pytest.mark.parametrize("cfg,keys", [u[1:] for u in UNREAD], ids=[u[0] for u in UNREAD])
def test_a_replica_groups_key_set_with_the_groups_off_is_named(cfg, keys):
    assert [key for key, _ in cfg.unread_keys()] == keys


def test_a_launch_refuses_the_keys_a_saved_runs_config_may_keep(tiny_config):
    from forge.training.setup.problems import replica_group_problems

    argv = [str(tiny_config), "--fault_tolerance.lighthouse=http://127.0.0.1:29510"]
    config = load_config(argv).config  # a reader (eval, export) loads it as it is
    assert replica_group_problems(config, {}) == [
        "fault_tolerance.lighthouse: is set, but fault_tolerance.enabled is false, so nothing "
        "reads it; set fault_tolerance.enabled = true for replica groups, or remove it"
    ]
