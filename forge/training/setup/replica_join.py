"""Joining the replica groups at set-up (``[fault_tolerance]``, docs/fault-tolerance.md): this
launch's manager, and the first step's quorum, in which a group behind heals from a live peer
before it writes any record."""

from __future__ import annotations

import attrs

from forge.resilience.replica_groups import GroupsLostError, ReplicaGroups
from forge.training.context import (
    CheckpointContext,
    DataContext,
    DistContext,
    ModelContext,
    RunContext,
)
from forge.training.steps.replicas import StepReplicas, heal_line, layout_fingerprint


def join_replica_groups(
    run: RunContext, dist: DistContext, model: ModelContext, data: DataContext,
    ckpt: CheckpointContext,
) -> tuple[StepReplicas | None, CheckpointContext]:  # fmt: skip
    """``[fault_tolerance]``: this launch's manager among the replica groups (None when off)
    and the first step's quorum, joined here: a group behind the others heals in it from a
    live peer (the returned context starts the loop at the peer's state), a group whose
    layout is not the peers' is refused before anything is written."""
    ft = run.config.fault_tolerance
    if not ft.enabled:
        return None, ckpt
    try:
        groups = ReplicaGroups(
            ft, dist.rank, dist.world_size, ckpt.initial_state.step, layout_fingerprint(run, dist)
        )
    except Exception as exc:  # torchft's servers could not start or connect: retryable
        raise GroupsLostError(
            f"fault_tolerance: the replica group's manager did not start ({exc}); check "
            "fault_tolerance.lighthouse and that this host's name resolves"
        ) from None
    accum = run.config.train.grad_accum_steps
    slots = accum * ft.groups
    # a pipeline's schedule runs a group's micro-batches `accum` at a time
    unit = accum if model.pipeline is not None else 1
    # the schedule in force (a peer behind receives it): a resume may keep a checkpoint's
    replicas = StepReplicas(groups, ckpt.applied_to(model), data.train_loader, slots, unit)
    try:
        quorum = replicas.join(ckpt.initial_state)
    except GroupsLostError as exc:
        groups.close()
        raise GroupsLostError(
            f"fault_tolerance: {exc} within fault_tolerance.quorum_timeout_s="
            f"{ft.quorum_timeout_s:g} s: are the other groups started, and is the lighthouse's "
            "--min-groups more than the groups alive?"
        ) from None
    except BaseException:
        groups.close()
        raise
    dist.say(
        f"replica group {ft.group} of {ft.groups}: {quorum.participants} taking part (a step's "
        f"{slots} micro-batches shared among them)"
    )
    if replicas.rebase is not None:
        healed, replicas.rebase = replicas.rebase, None
        dist.say(heal_line(healed.step, quorum))
        schedule, peak_lr = replicas.schedule or (None, None)  # the peer's, in force from here
        ckpt = attrs.evolve(ckpt, initial_state=healed, schedule=schedule, peak_lr=peak_lr)
        replicas.model = ckpt.applied_to(model)
    # every step's sums compare the LR schedule in force too: groups that resumed their own
    # checkpoints at one step under different schedules stop at the first, never train apart
    in_force = (replicas.model.schedule, replicas.model.peak_lr)
    replicas.groups.settle(layout_fingerprint(run, dist, in_force))
    return replicas, ckpt
