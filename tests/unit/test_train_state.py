"""The JSON train state: strict, but checkpoints written before a key was retired still parse."""

from __future__ import annotations

import pathlib

import attrs
import pytest

from forge.checkpoint.store import CheckpointError
from forge.training.loop.plan import SaveReason
from forge.training.records.train_state import (
    TRAIN_STATE_VERSION,
    LoaderRecord,
    ScheduleRecord,
    TrainState,
    parse_train_state,
    train_state_to_json,
)
from forge.types import LoopState

STATE = TrainState(
    format_version=TRAIN_STATE_VERSION,
    step=4,
    tokens_seen=4096,
    reason=SaveReason.SCHEDULED,
    loop_state=LoopState(step=4, tokens_seen=4096, last_saved_step=4),
    loader=LoaderRecord(32, 8, 0, (32,), "00000000000000ff"),
    schedule=ScheduleRecord("cosine", 2, 10, 12),
    world_size=1,
)
PATH = pathlib.Path("runs/x/checkpoints/step_4")


def test_a_train_state_round_trips():
    assert parse_train_state(train_state_to_json(STATE), PATH) == STATE


def test_an_older_train_state_with_the_retired_model_fingerprint_still_parses():
    older = train_state_to_json(STATE) | {"model_fingerprint": "3f2a9c0d1e4b5a6c"}
    assert parse_train_state(older, PATH) == STATE


def test_a_train_state_from_before_the_fp8_fallback_was_kept_parses_as_never_fallen_back():
    older = train_state_to_json(STATE)
    del older["loop_state"]["float8_fallback_step"]
    assert parse_train_state(older, PATH).loop_state.float8_fallback_step is None
    fell_back = attrs.evolve(
        STATE, loop_state=attrs.evolve(STATE.loop_state, float8_fallback_step=3)
    )
    assert parse_train_state(train_state_to_json(fell_back), PATH) == fell_back


def test_an_earlier_forges_micro_batch_position_is_refused_by_name_not_skipped():
    """Not damage (an older checkpoint would not fare better): a config error, exit 2."""
    from forge.config.loader import ConfigError

    earlier = train_state_to_json(STATE) | {"loader": {"micro_batch": 8, "cursors": [32]}}
    with pytest.raises(ConfigError, match=r"earlier forge.*cannot continue that order") as err:
        parse_train_state(earlier, PATH)
    assert not isinstance(err.value, CheckpointError) and "train_state.json" in str(err.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"surprise": 1}, "unknown key"),
        ({"step": "4"}, "field 'step' is invalid"),
        ({"step": 3}, "disagrees with its loop state"),
    ],
    ids=["an unknown key", "a wrong type", "a step the loop state contradicts"],
)
def test_a_malformed_train_state_is_refused_naming_the_file(change, message):
    with pytest.raises(CheckpointError, match=message) as err:
        parse_train_state(train_state_to_json(STATE) | change, PATH)
    assert "train_state.json" in str(err.value)
