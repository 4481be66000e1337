"""Train a model: ``python scripts/train.py CONFIG.toml [--section.key=value ...]``.

The same command line works under ``torchrun``. ``main`` only strings the phases together;
each phase is a named function in ``forge.training.setup.phases``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

if __name__ == "__main__":  # first: a signal waits for the imports and the config's checks;
    # then --help, before torch's import, which takes seconds
    from forge.resilience.signals import hold_shutdown_signals

    HELD = hold_shutdown_signals()
    from forge.cli import help_first
    from forge.config.help import help_text

    help_first(__name__, lambda _: print(help_text()))

from forge.config.help import help_text
from forge.console import console_may_close
from forge.errors import CheckpointSaveError, UserInputError, print_errors
from forge.metrics.goodput import Bucket, run_totals, summary_line
from forge.metrics.profiler import profiler_hooks
from forge.resilience import stragglers
from forge.resilience.control import ControlChannel, StepMonitor
from forge.resilience.faults import (
    Fault,
    FaultHooks,
    faults_from_env,
    gradient_faults,
    with_faults,
    with_slow_data,
)
from forge.resilience.health import guard_collectives
from forge.resilience.replica_groups import GroupsLostError
from forge.resilience.reports import FaultReport, fallback_kept_line
from forge.resilience.signals import (
    SetupInterrupted,
    ShutdownFlag,
    pause_if_asked,
    release_shutdown_signals,
)
from forge.resilience.stacks import StackWatch, native_crash_stacks, stack_watch
from forge.training.context import (
    CheckpointContext,
    DataContext,
    DistContext,
    ModelContext,
    RunContext,
)
from forge.training.evaluation.follow import follow_line
from forge.training.loop.effects import TrainingEffects
from forge.training.loop.hooks import HookList, Hooks, configured_hooks
from forge.training.loop.ledger import (
    LaunchClock,
    LedgerEffects,
    process_started,
    timed_batches,
    timed_poll,
    timed_step,
)
from forge.training.loop.loop import conclude, run_training_loop
from forge.training.loop.outcome import exit_code, log_failure_line, outcome_message
from forge.training.loop.plan import starting_outcome
from forge.training.setup.guards import armed_guards
from forge.training.setup.loaders import train_batches
from forge.training.setup.phases import (
    build_model_and_optim,
    claim_run_dir,
    load_and_validate_config,
    prepare_run_dir,
    setup_checkpointing,
    setup_data,
    setup_distributed,
    teardown,
)
from forge.training.setup.replica_join import join_replica_groups
from forge.training.steps.float8_check import kept_fallback
from forge.training.steps.replay import kernel_modes_kept
from forge.training.steps.replicas import (
    LayoutMismatchError,
    StepReplicas,
    replica_batches,
    replicated_step,
)
from forge.training.steps.select import make_step_fn
from forge.types import ExitCode, LoopOutcome, LoopState, StepResult


@console_may_close()  # a console that goes away is dropped: the run and its files go on
@kernel_modes_kept()  # train.deterministic changes them for this run only
def main(
    argv: Sequence[str] | None = None,
    hooks: Sequence[Hooks] = (),
    held: AbstractSet[int] | None = None,
) -> int:
    """Run the phases in order; returns the process exit code of the loop's outcome.
    ``held``: the signal mask before the script held the shutdown signals at its start
    (``hold_shutdown_signals``), put back once the config's own checks are done."""
    # a launch starts with its process (imports included); a call of main in a running
    # process (a notebook, a test) starts its launch at the call
    started = process_started() if argv is None else time.time()
    entered = time.time()
    args = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(args):
        print(help_text())
        return ExitCode.OK
    faults = faults_from_env(os.environ)  # test-only fault injection; none in production
    # a signal during set-up stops it (nothing written, exit 75 or 130); once set-up is done,
    # it asks the loop for an emergency save
    flag = ShutdownFlag(setting_up=True)
    lock, replicas = None, None
    try:
        flag.install()  # before set-up, so an early signal is not lost
        run = load_and_validate_config(
            args,
            lambda problems: release_shutdown_signals(held, problems) if held is not None else None,
        )
        dist = setup_distributed(run)
        model = build_model_and_optim(run, dist)
        data = setup_data(run, dist)
        channel = ControlChannel(dist.world_size, run.config.resilience.health_timeout_s)
        # refused before a checkpoint is loaded (and before the run dir is claimed)
        guards = armed_guards(run, dist, model, data, flag, channel)
        lock = claim_run_dir(run, dist)
        pause_if_asked(os.environ, "checkpoint")  # tests only: a signal in a known phase
        load_start = time.time()
        ckpt = setup_checkpointing(run, dist, model, data)
        replicas, ckpt = join_replica_groups(run, dist, model, data, ckpt)  # may heal
        clock = LaunchClock(run.run_dir, dist.is_main, started)
        verify_s = ckpt.resume_cost.verify_s if ckpt.resume_cost is not None else 0.0
        clock.started_up(entered, time.time() - load_start, verify_s)
        run_hooks = HookList(
            [
                *hooks,
                *configured_hooks(run.config.hooks),
                *profiler_hooks(run.config.profiler, run.run_dir, dist.rank),
                FaultReport(
                    dist.is_main,
                    dist.hosts,
                    run.config.resilience.on_spike,
                    nonfinite_policy=run.config.resilience.on_nonfinite,
                ),
                FaultHooks(faults, dist.rank),
            ]
        )
        prepare_run_dir(run, dist, ckpt)  # last: a set-up that fails writes no records
        if dist.is_main:
            print(f"[forge] {guards}", file=sys.stderr)
            ev = run.config.eval
            if (follow := follow_line(ev.follow, ev.interval, run.run_dir)) is not None:
                print(f"[forge] {follow}", file=sys.stderr)
        flag.setup_done()
    except BaseException as exc:
        if lock is not None:
            lock.release(discard=True)  # a run that never started leaves no directory
        if replicas is not None:
            replicas.groups.close()
        flag.uninstall()
        if isinstance(exc, SetupInterrupted):  # one line, not an error: nothing to save
            print(f"[forge] {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        if isinstance(exc, GroupsLostError):  # no quorum: retryable, unlike bad input
            print_errors([str(exc)])
            return ExitCode.HEALTH_FAILURE
        if not isinstance(exc, UserInputError):
            raise  # a bug: its traceback, with nothing of the set-up left behind
        print_errors(exc.lines)
        return ExitCode.CONFIG_ERROR
    try:
        timeout_s = run.config.distributed.timeout_s
        with stack_watch(run.run_dir, dist.rank, dist.world_size, timeout_s) as stacks:
            return train(
                run,
                dist,
                model,
                data,
                ckpt,
                flag,
                run_hooks,
                faults,
                stacks,
                clock,
                channel,
                replicas,
            )
    finally:
        flag.uninstall()  # done already unless the loop raised
        lock.release()
        if replicas is not None:
            replicas.groups.close()


def train(
    run: RunContext,
    dist: DistContext,
    model: ModelContext,
    data: DataContext,
    ckpt: CheckpointContext,
    flag: ShutdownFlag,
    hooks: HookList,
    faults: tuple[Fault, ...],
    stacks: StackWatch | None = None,
    clock: LaunchClock | None = None,
    channel: ControlChannel | None = None,
    replicas: StepReplicas | None = None,
) -> int:
    """The loop and what follows it, once every set-up phase succeeded; ``stacks``: where
    this rank's stacks go when the run hangs (re-armed before any other hook); ``clock``:
    this launch's goodput ledger (the set-up's load already in it); ``channel``: the control
    word's, made at set-up for the guards to check; ``replicas``: the replica groups
    (``[fault_tolerance]``), whose quorum decides each step's rows."""
    if clock is None:
        clock = LaunchClock(run.run_dir, dist.is_main, time.time())
    clock.replicated = replicas is not None
    flag.timeout_s = run.config.resilience.shutdown_timeout_s
    model = ckpt.applied_to(model)  # schedule_from = "checkpoint": the recorded LR schedule
    fell_back = ckpt.initial_state.float8_fallback_step
    model = kept_fallback(model, run.config.train.float8, fell_back)
    if model.float8_fallen_back and fell_back is not None:
        dist.say(fallback_kept_line(fell_back))
    if dist.is_main:
        print(f"[forge] {model.num_params:,} parameters; run dir {run.run_dir}", file=sys.stderr)
    policy = run.policy
    hooks = HookList([stacks, hooks]) if stacks is not None else hooks
    effects = TrainingEffects(run, dist, model, data, hooks=hooks)
    step = make_step_fn(
        run, dist, model, data, hooks, gradient_faults(faults, dist.rank), replicas=replicas
    )
    step: Callable[[Any, LoopState], StepResult] = with_faults(step, model.model, faults, dist.rank)
    batches: Iterator[Any] = train_batches(data, run.config.train.grad_accum_steps)
    if replicas is not None:  # each step's rows follow its quorum, read inside the step
        replicas.stop_requested = flag.requested  # a signal ends a step waiting for a quorum
        step, batches = replicated_step(step, replicas, dist.say), replica_batches(replicas)
    batches = with_slow_data(batches, faults, dist.rank, ckpt.initial_state.step + 1)
    waits = stragglers.LoaderWaits()  # a rank's wait for its own data is its own time too
    step, batches = stragglers.timed(step, waits=waits), waits.watch(batches)
    res = run.config.resilience
    if channel is None:
        channel = ControlChannel(dist.world_size, res.health_timeout_s)
    monitor = StepMonitor(
        channel,
        lambda: flag.requested() or effects.cannot_log(),  # rank 0 alone writes the metrics
        res.health_check_interval,
        effects.save_status,
    )
    effects.begin(ckpt.initial_state, ckpt.resume_cost)
    clock.loop_begins(
        ckpt.initial_state.step, steps_left=starting_outcome(ckpt.initial_state, policy) is None
    )
    timed_effects = LedgerEffects(effects, clock, effects.logger.measured, effects.committed_step)
    try:
        outcome, state = run_training_loop(
            ckpt.initial_state,
            timed_batches(batches, clock),
            timed_step(
                guard_collectives(step, dist.rank, run.config.distributed.timeout_s, stacks),
                clock,
            ),
            policy,
            timed_effects,
            timed_poll(monitor, clock),
        )
        decision, state = conclude(outcome, state, policy, timed_effects)
    except LayoutMismatchError as exc:  # a group that joined with another config
        effects.abandon()
        print_errors(exc.lines)
        flag.uninstall()
        teardown(dist, healthy=False)
        return ExitCode.CONFIG_ERROR
    except CheckpointSaveError as exc:  # every rank raises it: they agreed on the failure
        effects.abandon()
        print_errors([exc.run_ends_line, *([effects.log_failure] if effects.log_failure else [])])
        flag.uninstall()
        teardown(dist)
        clock.write(ended=True)
        return ExitCode.SAVE_FAILED
    ending = time.time()
    clock.step = state.step
    outcome = effects.outcome_after_saves(outcome)  # a peer lost during a save: HEALTH_FAILURE
    effects.end(outcome, state)
    if effects.log_failure is not None:  # an error when it stopped the run, else a warning
        line = log_failure_line(
            effects.log_failure, outcome, state.step, run.config.checkpoint.enabled
        )
        if outcome is LoopOutcome.SHUTDOWN:
            print_errors([line])
        else:
            print(f"[forge] warning: {line}", file=sys.stderr)
    if dist.is_main:
        print(f"[forge] {outcome.name} at step {state.step}; final save: {decision.reason.value}")
        message = outcome_message(outcome, state, policy, str(run.run_dir))
        if message:
            print(f"[forge] {message}")
    flag.uninstall()
    teardown(dist, healthy=outcome is not LoopOutcome.HEALTH_FAILURE)
    if outcome is LoopOutcome.ALREADY_COMPLETE:
        return exit_code(outcome)  # a run already complete changes nothing on disk
    clock.add(Bucket.SHUTDOWN, time.time() - ending)
    # a finished run (its steps, or its data): what follows it is not the run's time
    clock.completed = outcome in (LoopOutcome.COMPLETED, LoopOutcome.DATA_EXHAUSTED)
    clock.write(ended=True)
    if dist.is_main:  # this launch from memory: its last line counts whether or not written
        launches = clock.launches()
        print(f"[forge] {summary_line(run_totals(launches), len(launches))}", file=sys.stderr)
    return exit_code(outcome)


if __name__ == "__main__":
    native_crash_stacks()  # with faulthandler on, a crashed rank shows its C++ frames too
    code = main(held=HELD)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization: gloo threads kept alive by a device mesh can abort it
    # ("terminate called without an active exception"). Everything was flushed and closed.
    os._exit(code)
