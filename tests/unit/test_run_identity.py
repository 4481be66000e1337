"""Which config changes make a resume another run: the fingerprint table, and the verdict."""

from __future__ import annotations

import pytest

from forge.config import structure_config
from forge.training.identity import (
    DifferenceKind,
    ResumeVerdict,
    identity_differences,
    resume_verdict,
    run_identity,
)

BASE = {"train": {"batch_size": 4, "grad_accum_steps": 2, "max_steps": 500}}
GLOBAL = "global batch (train.batch_size × data-parallel size × grad_accum_steps)"
MODEL, DATA = DifferenceKind.MODEL, DifferenceKind.DATA_ORDER


def identity(overrides: dict, dp_size: int = 1, fingerprints=("abc",)) -> dict:
    raw = {k: dict(v) for k, v in BASE.items()}
    for key, value in overrides.items():
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    return run_identity(structure_config(raw), dp_size, fingerprints)


# (case, changed keys, dp size now, dataset fingerprint now, differing keys with their kind)
TABLE = [
    ("same config", {}, 1, "abc", []),
    ("rope theta", {"model.rope_theta": 5e5}, 1, "abc", [("model.rope_theta", MODEL)]),
    ("norm eps", {"model.norm_eps": 1e-6}, 1, "abc", [("model.norm_eps", MODEL)]),
    ("rope scaling set", {"model.rope_scaling": {"type": "llama3"}}, 1, "abc", [("model.rope_scaling", MODEL)]),
    ("a head size of its own", {"model.head_dim": 128}, 1, "abc", [("model.head_dim", MODEL)]),
    ("max seq len", {"model.max_seq_len": 512}, 1, "abc", [("model.max_seq_len", MODEL)]),
    ("init std", {"model.init_std": 0.01}, 1, "abc", [("model.init_std", MODEL)]),
    ("seq len", {"train.seq_len": 128}, 1, "abc", [("train.seq_len", DATA)]),
    ("seed (also the data seed)", {"train.seed": 7}, 1, "abc", [("train.seed", DATA), ("train.data_seed", DATA)]),
    ("data seed only", {"train.data_seed": 7}, 1, "abc", [("train.data_seed", DATA)]),
    ("global batch", {"train.batch_size": 2}, 1, "abc", [(GLOBAL, DATA)]),
    ("more accumulation", {"train.grad_accum_steps": 4}, 1, "abc", [(GLOBAL, DATA)]),
    ("2 ranks x 4 -> 1 rank x 8: same global batch", {"train.batch_size": 8}, 1, "abc", []),
    ("temperature", {"data.temperature": 2.0}, 1, "abc", [("data.temperature", DATA)]),
    ("packing", {"data.pack_documents": True}, 1, "abc", [("data.pack_documents", DATA)]),
    ("train split", {"data.train_split": "validation"}, 1, "abc", [("data.train_split", DATA)]),
    ("other data content", {}, 1, "xyz", [("data.sources", DATA)]),
    ("max steps, lr, eval: the same run", {"train.max_steps": 900, "optimizer.lr": 1e-3, "eval.interval": 5}, 1, "abc", []),
    ("checkpointing knobs: the same run", {"checkpoint.interval": 7, "checkpoint.keep_last_n": 1}, 1, "abc", []),
]  # fmt: skip

RECORDED_AT_TWO_RANKS = {"2 ranks x 4 -> 1 rank x 8: same global batch"}


@pytest.mark.parametrize(
    "name,changes,dp,fingerprint,expected", TABLE, ids=[row[0] for row in TABLE]
)
def test_fingerprint_table(name, changes, dp, fingerprint, expected):
    recorded_dp = 2 if name in RECORDED_AT_TWO_RANKS else 1
    recorded = identity({}, dp_size=recorded_dp)
    current = identity(changes, dp_size=dp, fingerprints=(fingerprint,))
    found = [(d.key, d.kind) for d in identity_differences(recorded, current)]
    assert found == expected


def test_differences_name_both_values():
    (difference,) = identity_differences(identity({}), identity({"model.rope_theta": 5e5}))
    assert difference.describe() == "model.rope_theta: 10000.0 in the checkpoint, 500000.0 now"


def test_keys_an_older_checkpoint_lacks_are_not_compared():
    recorded = {k: v for k, v in identity({}).items() if k != "data.sources"}
    assert identity_differences(recorded, identity({}, fingerprints=("other",))) == []


@pytest.mark.parametrize(
    ("now", "differs"),
    [
        ({}, False),  # the default is what a checkpoint from before the key was built with
        ({"model.rope_scaling": {"factor": 32.0}}, True),
        ({"model.head_dim": 128}, True),
    ],
)
def test_a_model_key_an_older_checkpoint_lacks_is_compared_with_its_default(now, differs):
    """A preset that gained ``[model.rope_scaling]`` does not silently rescale the positions
    of a checkpoint written before forge had the key."""
    older = {
        k: v for k, v in identity({}).items() if k not in ("model.rope_scaling", "model.head_dim")
    }
    found = [d.key for d in identity_differences(older, identity(now))]
    assert bool(found) is differs
    assert all(d.kind is MODEL for d in identity_differences(older, identity(now)))


def test_another_rope_scaling_factor_is_another_model_even_through_json():
    """A checkpoint records ``[model.rope_scaling]`` as a JSON object: a resume under another
    factor is refused (it changes every position's angle), the same one is the same run."""
    import json

    scaled = {"model.rope_scaling": {"factor": 8.0}}
    recorded = json.loads(json.dumps(identity(scaled)))
    assert identity_differences(recorded, identity(scaled)) == []
    (difference,) = identity_differences(
        recorded, identity({"model.rope_scaling": {"factor": 32.0}})
    )
    assert difference.key == "model.rope_scaling" and difference.kind is MODEL
    assert resume_verdict([difference], allow_config_change=False) is ResumeVerdict.REFUSE


def test_the_identity_survives_a_json_round_trip():
    import json

    recorded = json.loads(json.dumps(identity({"train.data_seed": 3})))
    assert identity_differences(recorded, identity({"train.data_seed": 3})) == []


# (differences, allow_config_change, verdict)
VERDICTS = [
    (False, False, ResumeVerdict.SAME_RUN),
    (False, True, ResumeVerdict.SAME_RUN),
    (True, False, ResumeVerdict.REFUSE),
    (True, True, ResumeVerdict.WARN),
]


@pytest.mark.parametrize("differs,allow,verdict", VERDICTS)
def test_resume_verdict(differs, allow, verdict):
    differences = identity_differences(
        identity({}), identity({"train.seq_len": 64} if differs else {})
    )
    assert resume_verdict(differences, allow) is verdict
