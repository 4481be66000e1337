"""Every config key is in exactly one change group of the one table, and each group's verdict
on a resume."""

from __future__ import annotations

import pytest

from forge.config.sections import JobConfig, ScheduleName, ScheduleSource
from forge.training.records.resume_rules import (
    DECAY,
    DERIVED,
    GROUPS,
    TOTAL,
    Change,
    ChangeGroup,
    ChangeOptions,
    change_verdict,
    changes,
    config_keys,
    group_of,
)
from forge.training.records.run_record import recorded_settings, schedule_shape

G = ChangeGroup


@pytest.mark.parametrize("key", config_keys())
def test_every_config_key_is_in_exactly_one_group(key):
    """Its own entry, or its section's; an entry inside a grouped section is an exception to
    it (model.attention: a kernel, in a section of identity keys), never a repeat."""
    section = key.split(".")[0]
    assert (key in GROUPS) or (section in GROUPS), key
    if key in GROUPS and section in GROUPS and key != section:
        assert GROUPS[key] is not GROUPS[section], key


def test_the_table_names_only_real_keys_sections_and_recorded_values():
    keys = set(config_keys())
    assert set(GROUPS) <= keys | {k.split(".")[0] for k in keys} | set(DERIVED)


@pytest.mark.parametrize(
    ("key", "group"),
    [
        ("model.dim", G.MODEL),
        ("freeze", G.FREEZE),
        ("freeze[2]", G.FREEZE),
        ("train.seq_len", G.DATA_ORDER),
        ("data.sources", G.DATA_ORDER),
        ("data.train_split", G.DATA_ORDER),
        ("optimizer.name", G.OPTIMIZER_STATE),
        ("optimizer.betas", G.OPTIMIZER_STATE),
        ("train.param_dtype", G.OPTIMIZER_STATE),
        ("optimizer.lr", G.SCHEDULE),
        ("scheduler.warmup_steps", G.SCHEDULE),
        ("train.max_steps", G.SCHEDULE),
        ("train.grad_clip_norm", G.NUMERICS),
        ("train.mixed_precision", G.NUMERICS),
        ("model.attention", G.NUMERICS),  # another kernel, the same model
        ("train.compile", G.NUMERICS),  # measured: step 7's grad norm differs on a CPU
        ("train.loss_chunk_size", G.NUMERICS),  # measured: a fresh run differs at step 2
        ("train.activation_checkpointing", G.FREE),  # measured: bit for bit
        ("metrics.log_interval", G.FREE),
        ("eval.interval", G.FREE),
        ("checkpoint.interval", G.FREE),
        ("data.num_workers", G.LAYOUT),
        ("train.batch_size", G.LAYOUT),  # the global batch is another value, DATA_ORDER
        ("train.grad_accum_steps", G.LAYOUT),
        ("distributed.dp_shard", G.LAYOUT),
        ("distributed.pp", G.LAYOUT),
        ("distributed.cp", G.LAYOUT),
        ("distributed.ep", G.LAYOUT),
        ("distributed.timeout_s", G.FREE),
        ("fault_tolerance.enabled", G.LAYOUT),  # replica groups split the same global batch
        ("fault_tolerance.groups", G.LAYOUT),
        ("fault_tolerance.lighthouse", G.FREE),
        ("fault_tolerance.timeout_s", G.FREE),
        ("hooks.classes", G.FREE),
        ("profiler.enabled", G.FREE),
    ],
)
def test_what_a_change_of_each_kind_of_key_means(key, group):
    assert group_of(key) is group


# (case, schedule, shape keys)
SHAPES = [
    ("none: nothing but the name", (ScheduleName.NONE, 5, 10, 0.1, 20), {"scheduler.name"}),
    (
        "constant: no decay",
        (ScheduleName.CONSTANT, 5, 10, 0.1, 20),
        {"scheduler.name", "scheduler.warmup_steps"},
    ),
    (
        "cosine: the decay, not the total",
        (ScheduleName.COSINE, 5, 10, 0.1, 20),
        {"scheduler.name", "scheduler.warmup_steps", DECAY, "scheduler.min_lr_ratio"},
    ),
    (
        "wsd: the total too",
        (ScheduleName.WSD, 5, 10, 0.1, 20),
        {"scheduler.name", "scheduler.warmup_steps", DECAY, "scheduler.min_lr_ratio", TOTAL},
    ),
]


@pytest.mark.parametrize(("schedule", "keys"), [c[1:] for c in SHAPES], ids=[c[0] for c in SHAPES])
def test_a_schedule_is_compared_by_what_its_curve_depends_on(schedule, keys):
    assert set(schedule_shape(*schedule)) == keys


def settings(**changes):
    config = JobConfig()
    recorded = recorded_settings(config, 3e-4, ScheduleName.COSINE, 100, 900, 0.1, 1000)
    return recorded | changes


def test_the_recorded_settings_cover_the_optimizer_numerics_and_schedule_groups():
    recorded = settings()
    groups = {group_of(k) for k in recorded}
    assert groups == {G.OPTIMIZER_STATE, G.NUMERICS, G.SCHEDULE}
    assert recorded["optimizer.name"] == "adamw" and recorded["optimizer.lr"] == 3e-4


def test_changes_name_key_old_and_new_value_and_skip_what_a_checkpoint_lacks():
    recorded = settings()
    current = settings(**{"optimizer.name": "lion", DECAY: 1100})
    del recorded["train.grad_clip_norm"]
    found = changes(recorded, current | {"train.grad_clip_norm": 5.0})
    assert sorted((c.key, c.group) for c in found) == [
        (DECAY, G.SCHEDULE),
        ("optimizer.name", G.OPTIMIZER_STATE),
    ]
    assert [c.describe() for c in found if c.key == "optimizer.name"] == [
        "optimizer.name: 'adamw' → 'lion'"
    ]


OPT = Change("optimizer.name", "adamw", "lion", G.OPTIMIZER_STATE)
LR = Change("optimizer.lr", 3e-4, 0.5, G.SCHEDULE)
CLIP = Change("train.grad_clip_norm", 1.0, 5.0, G.NUMERICS)

# (case, changes, exclude optimizer, schedule_from, refusals, their fragments, warned, fresh, keep)
VERDICTS = [
    ("nothing changed", [], False, None, 0, [], 0, False, False),
    (
        "optimizer changed: refused",
        [OPT],
        False,
        None,
        1,
        ["optimizer.name: 'adamw' → 'lion'", 'exclude_from_loading=["optimizer"]'],
        0,
        False,
        False,
    ),
    ("optimizer changed, excluded", [OPT], True, None, 0, [], 1, True, False),
    ("excluded without a change: the state loads", [], True, None, 0, [], 0, False, False),
    (
        "schedule changed: refused",
        [LR],
        False,
        None,
        1,
        ["optimizer.lr: 0.0003 → 0.5", 'schedule_from="checkpoint"', "from step 8"],
        0,
        False,
        False,
    ),
    (
        "schedule changed, from the checkpoint",
        [LR],
        False,
        ScheduleSource.CHECKPOINT,
        0,
        [],
        1,
        False,
        True,
    ),
    (
        "schedule changed, from the config",
        [LR],
        False,
        ScheduleSource.CONFIG,
        0,
        [],
        1,
        False,
        False,
    ),
    (
        "schedule_from without a change: nothing",
        [],
        False,
        ScheduleSource.CHECKPOINT,
        0,
        [],
        0,
        False,
        False,
    ),
    ("numerics changed: a warning", [CLIP], False, None, 0, [], 1, False, False),
    (
        "both refused: one line each",
        [OPT, LR],
        False,
        None,
        2,
        ["optimizer state", "LR schedule"],
        0,
        False,
        False,
    ),
]


@pytest.mark.parametrize(
    ("changes", "exclude", "source", "n_refused", "fragments", "warned", "fresh", "keep"),
    [c[1:] for c in VERDICTS],
    ids=[c[0] for c in VERDICTS],
)
def test_the_verdict_on_a_changed_config(
    changes, exclude, source, n_refused, fragments, warned, fresh, keep
):
    options = ChangeOptions(exclude_optimizer=exclude, schedule_from=source)
    verdict = change_verdict(changes, "runs/x/checkpoints/step_8", 8, options)
    text = " | ".join(verdict.refusals)
    assert len(verdict.refusals) == n_refused and all(f in text for f in fragments), text
    assert len(verdict.warnings) == warned
    assert (verdict.fresh_optimizer, verdict.keep_schedule) == (fresh, keep)


# (case, changes, refusals): a resume that trains no step follows no schedule
FINISHED = [
    ("already complete: the schedule does not matter", [LR], 0),
    ("already complete: the optimizer still does", [OPT, LR], 1),
]


@pytest.mark.parametrize(
    ("changes", "n_refused"), [c[1:] for c in FINISHED], ids=[c[0] for c in FINISHED]
)
def test_a_resume_that_trains_nothing_ignores_schedule_changes(changes, n_refused):
    verdict = change_verdict(changes, "step_12", 12, ChangeOptions(), trains=False)
    assert len(verdict.refusals) == n_refused and not verdict.keep_schedule


def test_every_optimizer_says_which_keys_it_ignores():
    from forge.config.sections import OptimizerName
    from forge.training.records.run_record import UNUSED_BY

    assert set(UNUSED_BY) == {name.value for name in OptimizerName}


@pytest.mark.parametrize(
    ("optimizer", "key", "value", "changed"),
    [
        ("adamw", "momentum", 0.5, False),
        ("adamw", "eps", 1e-6, True),
        ("lion", "eps", 1e-6, False),
        ("muon", "momentum", 0.5, True),
    ],
)
def test_a_key_the_optimizer_ignores_is_no_change(optimizer, key, value, changed):
    import attrs

    from forge.config.sections import OptimizerName

    def recorded(**optimizer_keys):
        base = JobConfig()
        opt = attrs.evolve(base.optimizer, name=OptimizerName(optimizer), **optimizer_keys)
        config = attrs.evolve(base, optimizer=opt)
        return recorded_settings(config, 3e-4, ScheduleName.COSINE, 100, 900, 0.1, 1000)

    assert bool(changes(recorded(), recorded(**{key: value}))) is changed


@pytest.mark.parametrize(
    ("mtp_depth", "changed"),
    [
        (0, False),  # measured: a resume with another weight and no depth is bit for bit
        (1, True),
    ],
)
def test_the_multi_token_weight_is_a_change_only_with_multi_token_depths(mtp_depth, changed):
    import attrs

    def recorded(weight: float) -> dict:
        base = JobConfig()
        config = attrs.evolve(
            base,
            model=attrs.evolve(base.model, mtp_depth=mtp_depth),
            train=attrs.evolve(base.train, mtp_loss_weight=weight),
        )
        return recorded_settings(config, 3e-4, ScheduleName.COSINE, 100, 900, 0.1, 1000)

    assert bool(changes(recorded(0.3), recorded(0.5))) is changed
