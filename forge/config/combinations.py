"""Cross-section checks: combinations that are each valid alone but not together."""

from __future__ import annotations

from forge.config.sections import Float8Recipe, JobConfig, Problem, ScheduleName


def cross_section_problems(config: JobConfig) -> list[Problem]:
    """Problems that involve more than one section."""
    p: list[Problem] = []
    if config.train.seq_len > config.model.max_seq_len:
        p.append(
            (
                "train.seq_len",
                f"must be <= model.max_seq_len={config.model.max_seq_len}, "
                f"got {config.train.seq_len}",
            )
        )
    sched = config.scheduler
    if 0 < config.train.max_steps <= sched.warmup_steps and sched.name is not ScheduleName.NONE:
        p.append(
            (
                "scheduler.warmup_steps",
                f"must be < train.max_steps={config.train.max_steps} "
                "(the run would end inside warmup)",
            )
        )
    window = config.checkpoint.dyn_ckpt_window
    if window is not None and window.start > config.train.max_steps:
        p.append(
            (
                "checkpoint.dyn_ckpt_window.start",
                f"is past train.max_steps={config.train.max_steps}; no milestone would fire",
            )
        )
    p += follow_problems(config)
    depth, seq = config.model.mtp_depth, config.train.seq_len
    if depth >= seq > 0:
        p.append(("model.mtp_depth", f"must be < train.seq_len={seq} (no target would be left)"))
    if config.train.float8 is not Float8Recipe.OFF and config.model.vlm is not None:
        p.append(("train.float8", "is not supported with model.vlm yet; set it to 'off'"))
    p += fault_tolerance_problems(config)
    return p


def fault_tolerance_problems(config: JobConfig) -> list[Problem]:
    """``[fault_tolerance]`` with what it does not run with yet: the share is read in the
    training process (no loader workers); image–caption rows are not counted alike; the FP8
    drift guard would judge each group's share alone."""
    if not config.fault_tolerance.enabled:
        return []
    p: list[Problem] = []
    if config.data.num_workers > 0:
        p.append(
            (
                "data.num_workers",
                "must be 0 with fault_tolerance.enabled (a group's share of a step is read "
                "once its quorum is known, in the training process)",
            )
        )
    if config.model.vlm is not None:
        p.append(("fault_tolerance.enabled", "does not run with model.vlm yet"))
    res = config.resilience
    for key, policy in (("on_nonfinite", res.on_nonfinite), ("on_spike", res.on_spike)):
        if policy.value == "rollback":  # each group's snapshot is its own launch's
            p.append(
                (
                    f"resilience.{key}",
                    "'rollback' does not run with fault_tolerance.enabled yet (a group that "
                    "healed holds another snapshot than its peers); use 'skip'",
                )
            )
    if config.train.float8_check > 0:  # a group would judge its own share, and fall back alone
        p.append(
            ("train.float8_check", "does not run with fault_tolerance.enabled yet; set it to 0")
        )
    return p


def follow_problems(config: JobConfig) -> list[Problem]:
    """``eval.follow``: the follower evaluates committed checkpoints, so the steps it is to
    evaluate must be saved."""
    ev, ck = config.eval, config.checkpoint
    if not ev.follow:
        return []
    if not ck.enabled:
        return [("eval.follow", "evaluates committed checkpoints, and checkpoint.enabled is false")]
    if ev.interval > 0 and ev.interval % ck.interval != 0:
        return [
            (
                "eval.follow",
                f"evaluates the checkpoints of every eval.interval={ev.interval} steps, but "
                f"checkpoint.interval={ck.interval} does not save them; make eval.interval a "
                "multiple of checkpoint.interval",
            )
        ]
    return []
