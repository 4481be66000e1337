"""The freeze schedule: which parameters train at which step, and what a schedule may not do."""

from __future__ import annotations

import pytest

from forge.config import ConfigError, load_config
from forge.config.freeze import (
    FreezeRule,
    is_frozen,
    schedule_problems,
    trainable_names,
    transition_steps,
)

NAMES = (
    "tok_embeddings.weight",
    "layers.0.attention.wq.weight",
    "layers.0.feed_forward.w1.weight",
    "layers.1.attention.wq.weight",
    "layers.1.feed_forward.w1.weight",
    "norm.weight",
    "output.weight",
)
# the head alone for 3 steps, then the last block too until step 6, then everything
STAGED = (
    FreezeRule("tok_embeddings", until_step=6),
    FreezeRule("layers", until_step=6),
    FreezeRule("layers.1", frozen=False, until_step=6),
    FreezeRule("layers.1", until_step=3),
)


@pytest.mark.parametrize(
    ("step", "trainable"),
    [
        (1, {"norm.weight", "output.weight"}),
        (3, {"norm.weight", "output.weight"}),
        (4, {"norm.weight", "output.weight", "layers.1.attention.wq.weight",
             "layers.1.feed_forward.w1.weight"}),
        (6, {"norm.weight", "output.weight", "layers.1.attention.wq.weight",
             "layers.1.feed_forward.w1.weight"}),
        (7, set(NAMES)),
        (1000, set(NAMES)),
    ],
)  # fmt: skip
def test_the_trainable_set_at_each_step(step, trainable):
    assert trainable_names(NAMES, STAGED, step) == trainable


@pytest.mark.parametrize(
    ("rules", "name", "step", "frozen"),
    [
        ((), "layers.0.attention.wq.weight", 1, False),  # no rule: trains
        ((FreezeRule("layers.0"),), "layers.0.attention.wq.weight", 10**6, True),  # forever
        ((FreezeRule("layers.0"),), "layers.10.attention.wq.weight", 1, False),  # not a prefix
        ((FreezeRule("layers.*.attention.*"),), "layers.1.attention.wq.weight", 1, True),
        ((FreezeRule("layers.*.attention.*"),), "layers.1.feed_forward.w1.weight", 1, False),
        ((FreezeRule("output.weight", until_step=2),), "output.weight", 2, True),
        ((FreezeRule("output.weight", until_step=2),), "output.weight", 3, False),
        # the last rule in force decides
        ((FreezeRule("layers"), FreezeRule("layers.0", frozen=False)), "layers.0.x", 1, False),
        ((FreezeRule("layers.0", frozen=False), FreezeRule("layers")), "layers.0.x", 1, True),
    ],
)
def test_which_rule_decides(rules, name, step, frozen):
    assert is_frozen(name, rules, step) is frozen


def test_transition_steps_follow_each_until_step():
    assert transition_steps(STAGED) == (4, 7)
    assert transition_steps((FreezeRule("x"),)) == ()


@pytest.mark.parametrize(
    ("rules", "fragment"),
    [
        ((FreezeRule("decoder"),), "freeze[0].module: 'decoder' covers no parameter"),
        ((FreezeRule("*"),), "every parameter is frozen at step 1"),
        (
            (FreezeRule("output", until_step=5), FreezeRule("output", frozen=False, until_step=2)),
            "'output.weight' trains before step 3 and is frozen again from it",
        ),
    ],
)
def test_schedule_problems(rules, fragment):
    problems = schedule_problems(NAMES, rules)
    assert any(fragment in line for line in problems), problems


def test_a_valid_schedule_has_no_problems():
    assert schedule_problems(NAMES, STAGED) == []


def test_freeze_entries_load_from_toml_and_bad_ones_name_their_key(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(
        '[[freeze]]\nmodule = "layers.*"\nuntil_step = 5\n\n'
        '[[freeze]]\nmodule = "output"\nfrozen = false\n'
    )
    rules = load_config([str(good)]).config.freeze
    assert rules == (FreezeRule("layers.*", True, 5), FreezeRule("output", False, None))
    bad = tmp_path / "bad.toml"
    bad.write_text('[[freeze]]\nmodul = "x"\n\n[[freeze]]\nmodule = "y"\nfrozen = "yes"\n')
    with pytest.raises(ConfigError) as info:
        load_config([str(bad)])
    assert info.value.lines == [
        "freeze[0].module: is required",
        "freeze[0].modul: unknown key; did you mean 'freeze[0].module'?",
        "freeze[1].frozen: expected true or false, got 'yes'",
    ]
    ranged = tmp_path / "ranged.toml"
    ranged.write_text('[[freeze]]\nmodule = " "\nuntil_step = 0\n')
    with pytest.raises(ConfigError) as info:
        load_config([str(ranged)])
    assert info.value.lines == [
        "freeze[0].module: must name a module or a pattern of parameter names",
        "freeze[0].until_step: must be >= 1, got 0",
    ]
    scalar = tmp_path / "scalar.toml"
    scalar.write_text("freeze = 3\n")
    with pytest.raises(
        ConfigError, match=r"freeze: expected an array of tables \(\[\[freeze\]\]\)"
    ):
        load_config([str(scalar)])
