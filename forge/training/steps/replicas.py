"""A step under ``[fault_tolerance]`` (docs/fault-tolerance.md): the quorum first, then this
group's share of the step's micro-batches, the step with its label count, gradients and
totals summed over the groups taking part, and the commit before the optimizer step; a step
that does not commit is run again, on the rows it had, by whichever groups are left.

Every committed step reads exactly the step's rows of forge's one row stream (the same as a
run without replica groups at the same global batch), shared among the groups that took part
(``forge.data.row_order.share_of``); its label weight counts every group's labels, so its loss
and gradient are those of the whole step whichever groups computed it.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
from torch.distributed.tensor import DTensor

from forge.config.fault_tolerance import FaultToleranceConfig
from forge.config.loader import CONVERTER
from forge.data.loader import TextLoader, loader_state, plan_at
from forge.data.row_order import share_of
from forge.errors import UserInputError
from forge.optim.schedules import Schedule
from forge.resilience.replica_groups import GroupsLostError, Quorum, ReplicaGroups, local
from forge.training.context import DistContext, ModelContext, RunContext
from forge.training.steps.common import fails_alone
from forge.training.steps.spec import StepFunction
from forge.types import LoopState, ReplicaStep, StepResult


class LayoutMismatchError(UserInputError):
    """A replica group whose layout, model or batch is not the other groups'."""


# sections that do not change what a step computes (each group has its own of these)
OWN_SECTIONS = ("run", "eval", "checkpoint", "metrics", "hooks", "profiler")


def layout_fingerprint(
    run: RunContext, dist: DistContext, schedule: tuple[Schedule, float | None] | None = None
) -> int:
    """What every replica group must share, in one number: its ranks and mesh, and every
    config section a step reads (the model, the batch, the optimizer and schedule, the
    freeze schedule, the guards' policies, the data) — a group that differs would sum other
    tensors, read other rows or apply another update. Logging, evaluation, checkpointing,
    the hooks and this group's index and address stay its own. ``schedule``: the LR schedule
    in force and its peak, once set-up has settled it (``checkpoint.schedule_from``, each
    group's own, may keep a checkpoint's instead of the config's)."""
    cfg = run.config
    shared = {name: value for name, value in attrs.asdict(cfg).items() if name not in OWN_SECTIONS}
    ft = cfg.fault_tolerance
    shared["fault_tolerance"] = (ft.groups, ft.min_groups)
    return zlib.crc32(repr((dist.world_size, repr(dist.dims), shared, schedule)).encode())


class StepReplicas:
    """The step's view of the replica groups: the sums it asks for, the commit, and the
    state a heal sends and applies. ``slots``: the micro-batches of one whole step (each
    group's ``train.grad_accum_steps`` × ``fault_tolerance.groups``); ``unit``: a group's
    share is a whole number of these (a pipeline's schedule runs its micro-batches so many
    at a time)."""

    def __init__(
        self,
        groups: ReplicaGroups,
        model: ModelContext,
        loader: TextLoader,
        slots: int,
        unit: int = 1,
    ) -> None:
        self.groups = groups
        self.model = model
        self.loader = loader
        self.slots = slots
        self.unit = unit
        self.committed = False
        self.vetoed = False
        self.state = LoopState()  # the state a peer behind receives: this step's start
        self.rebase: LoopState | None = None
        self.schedule: tuple[Schedule, float | None] | None = None  # a heal's, at set-up
        self._pending: Quorum | None = None
        # a signal asked the run to stop (set by the driver): a step waiting for a quorum ends
        self.stop_requested: Callable[[], bool] = lambda: False
        groups.register(self.payload, self.apply)

    # the step's sums --------------------------------------------------------------------
    def labels(self, total: torch.Tensor) -> torch.Tensor:
        """The step's labels over every group taking part (``total``: this group's); a
        group whose fingerprint differs ends the run with ``LayoutMismatchError``."""
        total = total.clone()
        terms = self.groups.layout_terms(total.device)
        self.groups.sum_([total, terms])
        # a sum a lost group broke says nothing of layouts: the step will not commit
        if not self.groups.failed() and not self.groups.agreed_layout(terms):
            raise LayoutMismatchError(mismatch_line())
        return total

    def totals(
        self, params: Sequence[torch.Tensor], vetoed: bool, *tensors: torch.Tensor | None
    ) -> None:
        """The gradients of ``params`` and the step's additive totals (loss, z-loss, MoE
        statistics, per-source sums, multi-token losses), summed in place over the groups;
        ``vetoed``: this group's own checks refuse the step, so no group commits it."""
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        veto = torch.tensor([float(vetoed)], dtype=torch.float64, device=device)
        self.groups.sum_([*grads, *(t for t in tensors if t is not None), veto])
        self.vetoed = float(veto.item()) > 0  # any group's: one host read, as the commit's

    def commit(self) -> bool:
        """Whether the step commits (every group asks, before its optimizer step): not when
        a group of the quorum vetoed it, else as torchft's manager says."""
        if self.vetoed:
            self.groups.veto("a replica group's own checks refused the step")
        self.committed = self.groups.commit()
        return self.committed

    def join(self, state: LoopState) -> Quorum:
        """The first step's quorum, at set-up (``state``: where this launch resumed): a group
        behind heals in it — refused, before the run directory is written, when the peer's
        layout is not this group's — and its ``rebase`` is the state the loop starts from.
        The first step then runs in this quorum."""
        self.state = state
        self._pending = self.groups.quorum()
        return self._pending

    def next_quorum(self) -> Quorum:
        """The quorum the set-up joined (once), else the next step's."""
        pending, self._pending = self._pending, None
        return pending if pending is not None else self.groups.quorum()

    # a heal -----------------------------------------------------------------------------
    def payload(self) -> dict[str, Any]:
        """What a peer behind receives: the model's and the optimizer's local tensors, the
        loader's position and the loop state at the start of this step, and the fingerprint
        (torchft calls it while this group waits in the quorum)."""
        model, optimizer = self.model.model, self.model.optimizer
        return {
            "fingerprint": self.groups.fingerprint,
            "model": {k: local(v) for k, v in model.state_dict().items()},
            "optimizer": locals_of(optimizer.state_dict()),
            "loader": self.loader.state_dict(),
            "loop": CONVERTER.unstructure(self.state),
            # the LR schedule in force (a resume may keep a checkpoint's: schedule_from)
            "schedule": (self.model.schedule, self.model.peak_lr),
        }

    def apply(self, payload: dict[str, Any]) -> None:
        """Take a peer's state (``payload``) as this group's: refused, before anything
        changes, when the peer's fingerprint is not this group's."""
        if payload.get("fingerprint") != self.groups.fingerprint:
            raise LayoutMismatchError(mismatch_line())
        model, optimizer = self.model.model, self.model.optimizer
        with torch.no_grad():
            for key, value in model.state_dict().items():
                local(value).copy_(payload["model"][key])
        rebase = CONVERTER.structure(payload["loop"], LoopState)
        freezer = self.model.freezer
        if freezer is not None:  # the optimizer's groups as the peer's, at the peer's step
            last = max(1, rebase.step)
            freezer.hold(freezer.trainable_at(last), last)
        optimizer.load_state_dict(like_params(payload["optimizer"], optimizer))
        self.loader.seek(loader_state(payload["loader"], self.loader.sampling))
        self.rebase = rebase
        self.schedule = payload["schedule"]


def mismatch_line() -> str:
    return (
        "fault_tolerance: this replica group's layout, model, batch or LR schedule in force is "
        "not the other groups' (every group runs the same config on as many ranks, and resumes "
        "with the same checkpoint.schedule_from); launch it with theirs"
    )


def locals_of(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its local shard."""
    if isinstance(tree, dict):
        return {k: locals_of(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(locals_of(v) for v in tree)
    return local(tree) if isinstance(tree, torch.Tensor) else tree


def like_params(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A peer's optimizer state (local shards) as this optimizer's: each tensor shaped as
    its parameter's shard becomes a DTensor laid out as the parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in saved["state"].items():
        param = params[int(index)]
        state[index] = {k: as_param(v, param) for k, v in values.items()}
    return {"state": state, "param_groups": saved["param_groups"]}


def as_param(value: Any, param: torch.Tensor) -> Any:
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if value.shape != param.to_local().shape:
        return value  # a scalar (Adam's step) or a state of its own shape
    return DTensor.from_local(
        value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )


@attrs.frozen
class Share:
    """The loop's placeholder for one step under replica groups: which rows the step reads
    is decided by its quorum, inside the step."""


def replica_batches(replicas: StepReplicas) -> Iterator[Share]:
    """One ``Share`` per step until the data is used up (the loop's batches)."""
    while plan_at(replicas.loader.state, replicas.loader.sampling) is not None:
        yield Share()


def replicated_step(
    step: StepFunction, replicas: StepReplicas, say: Callable[[str], None]
) -> Callable[[Share, LoopState], StepResult]:
    """``step`` under the replica groups' quorum: run until an attempt commits (the rows
    of one that does not are read again); the result says who took part, the attempts
    that failed, and a heal. No quorum in time: the step reports a failed collective
    (the run ends HEALTH_FAILURE, as when a peer inside a group is lost)."""

    cfg = replicas.groups.cfg

    def run(_share: Share, state: LoopState) -> StepResult:
        failed, rebase, heal_s = 0, None, 0.0
        waiting_since: float | None = None  # the first attempt of this step that did not run
        said: set[str] = set()  # each reason once per step
        while True:
            replicas.state = state
            try:
                quorum = replicas.next_quorum()
            except GroupsLostError as exc:
                say(lost_line(state.step + 1, cfg, str(exc)))
                return lost_result()
            if replicas.rebase is not None:  # healed inside the loop: the peer's state
                state = rebase = replicas.rebase
                replicas.rebase = None
                say(heal_line(state.step, quorum))
            heal_s = quorum.heal_s if quorum.healed else heal_s
            wait = quorum_problem(quorum.participants, cfg.groups, cfg.min_groups)
            ran = wait is None  # a step that ran and failed retries at once; a wait sleeps
            if ran:
                share = replicas.loader.step_share(
                    share_of(replicas.slots, quorum.participants, quorum.rank, replicas.unit)
                )
                if share is None:  # a peer ahead used the data up: nothing left for this step
                    return lost_result()
                batches, after = share
                try:
                    result = step(batches, state)
                except GroupsLostError as exc:  # the commit itself did not answer
                    say(lost_line(state.step + 1, cfg, str(exc)))
                    return lost_result()
                if fails_alone(result.replay, result.float8):  # its own checks end the run
                    return result
                if replicas.committed:
                    replicas.loader.seek(after)
                    report = ReplicaStep(quorum.participants, failed, rebase, heal_s)
                    return attrs.evolve(result, replicas=report)
                failed += 1
                wait = (
                    f"it did not commit ({quorum.participants} {groups_word(quorum.participants)} "
                    "took part, one was lost inside it): its rows are read again"
                )
            assert wait is not None  # the quorum's problem, or the attempt's failure
            if wait not in said:
                said.add(wait)
                say(f"step {state.step + 1}: {wait}")
            now = time.monotonic()
            waiting_since = now if waiting_since is None else waiting_since
            if now - waiting_since > cfg.quorum_timeout_s:
                say(lost_line(state.step + 1, cfg, f"no step committed: {wait}"))
                return lost_result()
            if replicas.stop_requested():  # a signal: the last committed state stands
                say(
                    f"stopped at step {state.step + 1} while waiting for replica groups; "
                    "the last checkpoint stands"
                )
                return lost_result()
            if not ran:
                time.sleep(min(1.0, cfg.heartbeat_ms / 1000 * 2))  # the quorum will change

    return run


def quorum_problem(participants: int, groups: int, min_groups: int) -> str | None:
    """Why a step may not run in a quorum of ``participants`` groups (None: it may): fewer
    than ``fault_tolerance.min_groups``, or more than ``fault_tolerance.groups`` (two
    launches with one group index: their shares would overlap)."""
    if participants > groups:
        return (
            f"{participants} groups take part, more than fault_tolerance.groups={groups}: two "
            "launches share a group index; waiting for the quorum to shrink"
        )
    if participants < min_groups:
        return (
            f"{participants} of fault_tolerance.min_groups={min_groups} groups take part; "
            "waiting for more"
        )
    return None


def groups_word(n: int) -> str:
    return "group" if n == 1 else "groups"


def heal_line(step: int, quorum: Quorum) -> str:
    n = quorum.participants
    return (
        f"healed from a live peer at step {step} in {quorum.heal_s:.2f} s; "
        f"{n} {groups_word(n)} take{'s' if n == 1 else ''} part"
    )


def lost_line(step: int, cfg: FaultToleranceConfig, cause: str) -> str:
    return (
        f"replica groups lost at step {step}: {cause} within fault_tolerance.quorum_timeout_s="
        f"{cfg.quorum_timeout_s:g} s (the lighthouse stopped answering, too few groups are "
        "alive, or a rank of this group is gone); relaunch the groups once the lighthouse "
        "answers"
    )


def lost_result() -> StepResult:
    return StepResult(
        loss=float("nan"), grad_norm=float("nan"), tokens=0, lr=0.0, collective_failed=True
    )
