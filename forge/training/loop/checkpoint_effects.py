"""A run's checkpoints as the loop's plans ask: the train state saved beside the tensors, the
save, its wait and commit (retention, ``on_checkpoint_save``), the final export, a failed
save's verdict (a peer lost during a save: a health failure), and the in-memory rollback
slot."""

from __future__ import annotations

import sys
from typing import Any

import attrs
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from forge.checkpoint.async_staging import stop_checkpoint_process
from forge.checkpoint.checkpointer import Checkpointer
from forge.checkpoint.costs import SaveCost
from forge.checkpoint.paths import CheckpointPath
from forge.checkpoint.save_failures import PeerLostError
from forge.checkpoint.slots import Slots
from forge.checkpoint.store import apply_retention
from forge.config.loader import CONVERTER
from forge.config.sections import AsyncMode
from forge.errors import CheckpointSaveError, one_line
from forge.interop.export import export_model, tokenizer_info
from forge.optim.optimizers import evaluation_weights
from forge.resilience.stalls import backend_reason
from forge.training.context import DataContext, DistContext, ModelContext, RunContext
from forge.training.loop.hooks import HookList
from forge.training.loop.plan import SaveReason, save_failure_is_fatal
from forge.training.records.run_record import current_settings, run_identity
from forge.training.records.run_records import record_commit
from forge.training.records.train_state import (
    TRAIN_STATE_VERSION,
    LoaderRecord,
    ScheduleRecord,
    TrainState,
    train_state_to_json,
)
from forge.types import LoopOutcome, LoopState

ROLLBACK_SLOT = "rollback"


class CheckpointEffects:
    """Saves, commits, exports and rolls back one training run's model and optimizer."""

    def __init__(
        self,
        run: RunContext,
        dist: DistContext,
        model: ModelContext,
        data: DataContext,
        hooks: HookList,
    ) -> None:
        self.run = run
        self.dist = dist
        self.model = model
        self.data = data
        self.hooks = hooks
        self.slots = Slots(model.model, model.optimizer)
        self._schedule = run.policy.schedule
        self._save_reasons: dict[int, SaveReason] = {}
        self.checkpointer = Checkpointer(
            run.checkpoint_dir,
            run.config.checkpoint.async_mode,
            dist.rank,
            dist.world_size,
            on_commit=self._committed,
            daemon_log=run.run_dir / f"checkpoint_process_rank{dist.rank}.log",
            timeout_s=run.config.distributed.timeout_s,
        )
        # a save found a peer stalled or dead: no later save can complete, and the run ends
        # HEALTH_FAILURE (``outcome_after_saves``)
        self.lost_peer: PeerLostError | None = None

    def train_state(self, state: LoopState, reason: SaveReason) -> dict[str, Any]:
        """The JSON train state saved beside the tensors."""
        loader = self.data.train_loader.state_dict()  # the same position on every rank
        schedule = self.model.schedule
        return train_state_to_json(
            TrainState(
                format_version=TRAIN_STATE_VERSION,
                step=state.step,
                tokens_seen=state.tokens_seen,
                reason=reason,
                loop_state=state,
                loader=CONVERTER.structure(loader, LoaderRecord),
                schedule=ScheduleRecord(
                    schedule.name.value,
                    schedule.warmup_steps,
                    schedule.decay_steps,
                    schedule.total_steps,
                ),
                world_size=self.dist.world_size,
                identity=run_identity(self.run.config, self.dist.dp_size, self.data.fingerprints),
                settings=current_settings(self.run.config, self.model.peak_lr, self.model.schedule),
            )
        )

    def save(self, state: LoopState, reason: SaveReason) -> bool:
        """Start a save (it commits in ``wait``, at once in synchronous mode); whether it
        started. A failed save is reported and training goes on, unless
        ``save_failure_is_fatal`` says otherwise: then ``CheckpointSaveError`` ends the run."""
        self.wait()  # an earlier save's failure is handled before this one starts
        if self.lost_peer is not None:  # its collectives would fail again
            return False
        saved = attrs.evolve(state, last_saved_step=state.step)
        self._save_reasons[state.step] = reason
        try:
            self.checkpointer.save(
                state.step, self.model.model, self.model.optimizer, self.train_state(saved, reason)
            )
        except CheckpointSaveError as exc:
            self._save_failed(exc)
            return False
        except PeerLostError as exc:
            self.lost_peer = exc
            return False
        if reason is SaveReason.FINAL and self.run.config.checkpoint.export_final:
            self.export()
        return True

    def _committed(self, step: int, path: CheckpointPath) -> None:
        """Rank 0, after a commit: the run's record of it, retention, then
        ``on_checkpoint_save``."""
        try:
            record_commit(self.run.run_dir, step)
        except OSError as exc:  # the checkpoint stands; only the check of a later start weakens
            print(
                f"[forge] warning: cannot record the commit of step {step}: {exc}", file=sys.stderr
            )
        if self._schedule is not None:
            keep = self.run.config.checkpoint.keep_last_n
            try:
                apply_retention(self.run.checkpoint_dir, keep, self._schedule)
            except OSError as exc:  # a store that stopped answering: the next commit retries
                print(f"[forge] warning: retention after step {step}: {one_line(exc)}",
                      file=sys.stderr)  # fmt: skip
        self.hooks.on_checkpoint_save(step, path)

    def export(self) -> None:
        """Write ``<run.dir>/export``: the full model in Llama safetensors layout (rank 0)."""
        with evaluation_weights(self.model.optimizer):  # Schedule-Free: the averaged weights
            full = get_model_state_dict(
                self.model.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        if self.dist.is_main:
            ck = self.run.config.checkpoint
            tensors = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
            export_model(
                tensors,
                self.run.config.model,
                self.run.export_dir,
                ck.export_dtype.value,
                tokenizer_info(self.data.manifest.tokenizer),
            )

    def save_status(self) -> tuple[bool, bool]:
        """Whether a save is in flight, and whether this rank has written it."""
        return self.checkpointer.status()

    def wait(self) -> None:
        """Finish and commit the save in flight, if any."""
        try:
            self.checkpointer.wait()
        except CheckpointSaveError as exc:
            self._save_failed(exc)
        except PeerLostError as exc:
            self.lost_peer = self.lost_peer or exc

    def outcome_after_saves(self, outcome: LoopOutcome) -> LoopOutcome:
        """How the run ends once its saves are done: ``outcome``, or HEALTH_FAILURE when a
        save found a peer gone. Its one line is printed here unless the loop had ended
        HEALTH_FAILURE already (a step's collective failed first and named it)."""
        if self.lost_peer is None or outcome is LoopOutcome.HEALTH_FAILURE:
            return outcome
        print(f"[forge] error: {lost_peer_line(self.dist.rank, self.lost_peer)}", file=sys.stderr)
        return LoopOutcome.HEALTH_FAILURE

    def _save_failed(self, exc: CheckpointSaveError) -> None:
        reason = self._save_reasons.pop(exc.step, SaveReason.SCHEDULED)
        if save_failure_is_fatal(reason, exc.step, self.run.config.train.max_steps, exc.abandoned):
            raise exc
        if self.dist.is_main:
            print(f"[forge] warning: {exc}; training goes on", file=sys.stderr, flush=True)

    def snapshot(self) -> None:
        """Refresh the in-memory rollback slot (model + optimizer, CPU clones)."""
        self.slots.push(ROLLBACK_SLOT)

    def restore(self, state: LoopState) -> None:
        """Load the rollback slot taken at ``state`` back into the model and optimizer."""
        freezer = self.model.freezer
        if freezer is not None:  # the optimizer's parameters as at the snapshot
            step = max(1, state.step)
            freezer.hold(freezer.trainable_at(step), step)
        self.slots.load(ROLLBACK_SLOT)
        if self.dist.is_main:
            print(f"[forge] rolled back to step {state.step}", file=sys.stderr)

    def abandon(self) -> None:
        """After a fatal save failure: stop the checkpoint process, without waiting for
        its write."""
        if self.run.config.checkpoint.async_mode is AsyncMode.ASYNC_PROCESS:
            stop_checkpoint_process(grace_s=0.0)
        self.checkpointer.stager.close()
        self.checkpointer.stop_threads(wait=False)

    def close(self) -> None:
        """Commit the save in flight and stop the checkpointer's threads and process."""
        self.checkpointer.close()

    def take_costs(self) -> list[SaveCost]:
        """This rank's costs of the saves committed since the last call."""
        costs, self.checkpointer.costs = self.checkpointer.costs, []
        return costs


def lost_peer_line(rank: int, lost: PeerLostError) -> str:
    """The one line a rank prints when a collective of a save failed (``stall_line``'s kin)."""
    return (
        f"rank {rank}: a collective of the save of step {lost.step} failed: a peer is stalled "
        f"or dead ({backend_reason(lost.message)}); step {lost.step} was not saved; the run "
        "ends HEALTH_FAILURE: check the other ranks' logs, then resume"
    )
