"""What a checkpoint records of its run, and which config changes make a resume another run:
the fingerprint table, every identity key, and the verdict."""

from __future__ import annotations

import pytest

from forge.config import structure_config
from forge.training.records.resume_rules import (
    GLOBAL_BATCH,
    ChangeGroup,
    ChangeOptions,
    change_verdict,
    changes,
)
from forge.training.records.run_record import predated_model_defaults, run_identity

BASE = {"train": {"batch_size": 4, "grad_accum_steps": 2, "max_steps": 500}}
GLOBAL = GLOBAL_BATCH
MODEL, DATA = ChangeGroup.MODEL, ChangeGroup.DATA_ORDER


def identity_differences(recorded, current):
    return changes(recorded, current, predated_model_defaults())


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
    found = [(d.key, d.group) for d in identity_differences(recorded, current)]
    assert found == expected


def test_differences_name_both_values():
    (difference,) = identity_differences(identity({}), identity({"model.rope_theta": 5e5}))
    assert difference.describe() == "model.rope_theta: 10000.0 → 500000.0"


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
    assert all(d.group is MODEL for d in identity_differences(older, identity(now)))


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
    assert difference.key == "model.rope_scaling" and difference.group is MODEL
    assert change_verdict([difference], "step_4", 4, ChangeOptions()).refusals


def test_the_identity_survives_a_json_round_trip():
    import json

    recorded = json.loads(json.dumps(identity({"train.data_seed": 3})))
    assert identity_differences(recorded, identity({"train.data_seed": 3})) == []


# (differs, allow_config_change, refused, warned)
VERDICTS = [
    (False, False, 0, 0),
    (False, True, 0, 0),
    (True, False, 1, 0),
    (True, True, 0, 1),
]


@pytest.mark.parametrize("differs,allow,refused,warned", VERDICTS)
def test_the_verdict_on_another_run(differs, allow, refused, warned):
    found = identity_differences(identity({}), identity({"train.seq_len": 64} if differs else {}))
    verdict = change_verdict(found, "step_4", 4, ChangeOptions(allow_config_change=allow))
    assert (len(verdict.refusals), len(verdict.warnings)) == (refused, warned)
    if refused:
        assert "different data order" in verdict.refusals[0]
        assert "train.seq_len: 256 → 64" in verdict.refusals[0]


# Every key of the identity groups, changed alone (``structure_config`` overrides; ``data.path``
# with another dataset's fingerprint), and the recorded value that must differ. A key added
# to an identity group without a row here fails the coverage test below.
EVERY_IDENTITY_KEY = {
    "model.dim": ({"model.dim": 128}, "model.dim"),
    "model.n_layers": ({"model.n_layers": 2}, "model.n_layers"),
    "model.n_heads": ({"model.n_heads": 8}, "model.n_heads"),
    "model.n_kv_heads": ({"model.n_kv_heads": 2}, "model.n_kv_heads"),
    "model.head_dim": ({"model.head_dim": 32}, "model.head_dim"),
    "model.vocab_size": ({"model.vocab_size": 300}, "model.vocab_size"),
    "model.ffn_hidden_dim": ({"model.ffn_hidden_dim": 512}, "model.ffn_hidden_dim"),
    "model.multiple_of": ({"model.multiple_of": 64}, "model.multiple_of"),
    "model.norm_eps": ({"model.norm_eps": 1e-6}, "model.norm_eps"),
    "model.rope_theta": ({"model.rope_theta": 5e5}, "model.rope_theta"),
    "model.rope_scaling": ({"model.rope_scaling": {"factor": 8.0}}, "model.rope_scaling"),
    "model.max_seq_len": ({"model.max_seq_len": 512}, "model.max_seq_len"),
    "model.tie_embeddings": ({"model.tie_embeddings": True}, "model.tie_embeddings"),
    "model.init_std": ({"model.init_std": 0.01}, "model.init_std"),
    "model.qk_norm": ({"model.qk_norm": True}, "model.qk_norm"),
    "model.sliding_window": ({"model.sliding_window": 64}, "model.sliding_window"),
    "model.moe_num_experts": ({"model.moe_num_experts": 4}, "model.moe_num_experts"),
    "model.moe_top_k": ({"model.moe_top_k": 1}, "model.moe_top_k"),
    "model.moe_shared_experts": ({"model.moe_shared_experts": 1}, "model.moe_shared_experts"),
    "model.moe_hidden_dim": ({"model.moe_hidden_dim": 128}, "model.moe_hidden_dim"),
    "model.moe_every": ({"model.moe_every": 2}, "model.moe_every"),
    "model.moe_first_dense": ({"model.moe_first_dense": 1}, "model.moe_first_dense"),
    "model.moe_router": ({"model.moe_router": "sigmoid"}, "model.moe_router"),
    "model.moe_capacity_factor": ({"model.moe_capacity_factor": 1.25}, "model.moe_capacity_factor"),
    "model.moe_aux_loss_weight": ({"model.moe_aux_loss_weight": 0.1}, "model.moe_aux_loss_weight"),
    "model.moe_z_loss_weight": ({"model.moe_z_loss_weight": 1e-3}, "model.moe_z_loss_weight"),
    "model.moe_bias_update_rate": ({"model.moe_bias_update_rate": 1e-3}, "model.moe_bias_update_rate"),
    "model.moe_num_groups": ({"model.moe_num_groups": 2}, "model.moe_num_groups"),
    "model.moe_top_groups": ({"model.moe_top_groups": 2}, "model.moe_top_groups"),
    "model.moe_routed_scale": ({"model.moe_routed_scale": 2.5}, "model.moe_routed_scale"),
    "model.mtp_depth": ({"model.mtp_depth": 1}, "model.mtp_depth"),
    "model.mtp_moe": ({"model.mtp_moe": True, "model.mtp_depth": 1, "model.moe_num_experts": 4}, "model.mtp_moe"),
    "model.mla": ({"model.mla": {"kv_rank": 64}}, "model.mla"),
    "model.vlm": ({"model.vlm": "joint_decoder"}, "model.vlm"),
    "model.vision": ({"model.vision": {"image_size": 64}}, "model.vision"),
    "train.seq_len": ({"train.seq_len": 128}, "train.seq_len"),
    "train.seed": ({"train.seed": 7}, "train.seed"),
    "train.data_seed": ({"train.data_seed": 7}, "train.data_seed"),
    "data.path": ({"data.path": "elsewhere"}, "data.sources"),  # another dataset there
    "data.train_split": ({"data.train_split": "validation"}, "data.train_split"),
    "data.sources": ({"data.sources": [{"name": "a", "path": "x"}, {"name": "b", "path": "y"}]}, "data.sources"),
    "data.temperature": ({"data.temperature": 2.0}, "data.temperature"),
    "data.phases": ({"data.phases": [{"start_step": 5, "lr_scale": 0.5}]}, "data.phases"),
    "data.pack_documents": ({"data.pack_documents": True}, "data.pack_documents"),
    "freeze": ({"freeze": [{"module": "tok_embeddings"}]}, "freeze (entries)"),
}  # fmt: skip


def test_every_key_of_an_identity_group_has_a_row():
    from forge.training.records.resume_rules import IDENTITY, config_keys, group_of

    assert set(EVERY_IDENTITY_KEY) == {k for k in config_keys() if group_of(k) in IDENTITY}


def changed_identity(overrides: dict, fingerprints=("abc",)) -> dict:
    raw: dict = {k: dict(v) for k, v in BASE.items()}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if name:
            raw.setdefault(section, {})[name] = value
        else:
            raw[section] = value
    return run_identity(structure_config(raw), 1, fingerprints)


@pytest.mark.parametrize("key", EVERY_IDENTITY_KEY)
def test_a_change_of_every_identity_key_alone_changes_the_recorded_identity(key):
    """So no key can be listed as identity and not compared (``data.train_split`` was)."""
    overrides, recorded_key = EVERY_IDENTITY_KEY[key]
    fingerprints = ("other",) if key == "data.path" else ("abc",)
    if key == "data.sources":
        fingerprints = ("abc", "def")
    base = {"model.vlm": "joint_decoder"} if key == "model.vision" else {}  # vision needs it
    before, after = changed_identity(base), changed_identity(base | overrides, fingerprints)
    assert recorded_key in {c.key for c in identity_differences(before, after)}


# layout keys changed at the same global batch (8 rows at 1 data-parallel rank): the same run
SAME_GLOBAL_BATCH = [
    {"train.batch_size": 8, "train.grad_accum_steps": 1},
    {"train.batch_size": 1, "train.grad_accum_steps": 8},
    {"data.num_workers": 2},
    {"distributed.tp": 2, "distributed.pp": 2, "distributed.cp": 2, "distributed.ep": 2},
]


@pytest.mark.parametrize("overrides", SAME_GLOBAL_BATCH)
def test_a_layout_change_at_the_same_global_batch_is_the_same_run(overrides):
    assert identity_differences(changed_identity({}), changed_identity(overrides)) == []


def test_a_latent_attention_run_recorded_with_key_value_heads_resumes_without_them():
    """[model.mla] refuses n_kv_heads and head_dim (it has no use for them); a run recorded
    with them before that is the same model without them, not another."""
    import attrs

    from forge.config.model import LatentConfig

    latent = structure_config({**BASE, "model": {"mla": {"kv_rank": 16}}})
    assert isinstance(latent.model.mla, LatentConfig)
    older = attrs.evolve(latent, model=attrs.evolve(latent.model, n_kv_heads=2, head_dim=32))
    recorded = run_identity(older, 1, ("abc",)) | {"model.n_kv_heads": 2, "model.head_dim": 32}
    assert identity_differences(recorded, run_identity(latent, 1, ("abc",))) == []
    assert "model.n_kv_heads" not in run_identity(latent, 1, ("abc",))
