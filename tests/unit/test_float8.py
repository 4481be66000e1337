"""FP8 training (``train.float8``, ``forge.parallel.float8``): which linear layers compute in
FP8 (a table over names and shapes, and over whole models), the start-up line, the refusals
(torchao missing, a GPU without FP8 tensor cores, a vision-language model), and the swap
itself on a small model: torchao's layers where the rule says, the state dict unchanged, and
a forward close to the high-precision one."""

from __future__ import annotations

import builtins

import attrs
import pytest
import torch

from forge.config.latent import LatentConfig
from forge.config.loader import ConfigError
from forge.config.model import ModelConfig, MoeRouter
from forge.config.sections import Float8Recipe
from forge.parallel.float8 import (
    Kept,
    apply_float8,
    float8_layers,
    float8_problem,
    float8_start_line,
    kept_reason,
)

torchao = pytest.importorskip("torchao")  # the fp8 extra, in dev: runs in `make test`


@pytest.mark.parametrize(
    ("name", "shape", "why"),
    [
        ("layers.0.attention.wq", (64, 64), None),
        ("layers.3.feed_forward.w2", (64, 176), None),
        ("output", (256, 64), Kept.HEAD),  # the logits set the loss
        ("layers.1.feed_forward.router.gate", (16, 64), Kept.ROUTER),
        ("mtp.1.block.feed_forward.router.gate", (16, 64), Kept.ROUTER),
        ("layers.0.attention.wkv_a", (80, 64), None),
        ("layers.0.attention.wkv_a", (68, 64), Kept.SHAPE),
        ("layers.0.feed_forward.w1", (170, 64), Kept.SHAPE),
        ("mtp.1.proj", (64, 128), None),
    ],
)
def test_which_linear_layers_compute_in_fp8(name, shape, why):
    assert kept_reason(name, shape) is why


DENSE = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=32)


@pytest.mark.parametrize(
    ("cfg", "converted", "kept"),
    [
        (DENSE, 14, [("output", Kept.HEAD)]),
        # two MoE blocks: a router gate each stays, the experts are no Linear (not listed)
        (attrs.evolve(DENSE, moe_num_experts=4, moe_router=MoeRouter.SIGMOID), 8,
         [("layers.0.feed_forward.router.gate", Kept.ROUTER),
          ("layers.1.feed_forward.router.gate", Kept.ROUTER), ("output", Kept.HEAD)]),
        # a multi-token depth: its projection and block too
        (attrs.evolve(DENSE, mtp_depth=1), 22, [("output", Kept.HEAD)]),
        # latent attention whose latent (kv_rank 24 + rope 4) is no multiple of 16
        (attrs.evolve(DENSE, mla=LatentConfig(kv_rank=24, q_rank=0, nope_dim=12, rope_dim=4,
                                              v_dim=16)), 10,
         [("layers.0.attention.wkv_a", Kept.SHAPE), ("layers.0.attention.wkv_b", Kept.SHAPE),
          ("layers.1.attention.wkv_a", Kept.SHAPE), ("layers.1.attention.wkv_b", Kept.SHAPE),
          ("output", Kept.HEAD)]),
    ],
    ids=["dense", "moe", "mtp", "latent attention"],
)  # fmt: skip
def test_a_models_fp8_layers_follow_the_rule_and_the_start_up_line_lists_the_rest(
    cfg, converted, kept
):
    layers = float8_layers(cfg)
    assert len(layers.converted) == converted and list(layers.kept) == kept
    line = layers.describe(Float8Recipe.ROWWISE, emulated=True)
    assert line.startswith(f"float8 rowwise: {converted} linear layers in FP8, emulated on a CPU")
    assert all(name in line for name, _ in kept)


def test_the_swap_follows_the_rule_and_keeps_the_state_dict_and_the_forward():
    from forge.model.transformer import Transformer

    torch.manual_seed(0)
    plain = Transformer(DENSE)
    fp8 = Transformer(DENSE)
    fp8.load_state_dict(plain.state_dict())
    swapped = apply_float8(fp8, Float8Recipe.TENSORWISE, emulate=True)
    assert swapped == float8_layers(DENSE).converted
    assert type(fp8.output) is torch.nn.Linear  # the head stays
    assert type(fp8.layers["0"].attention.wq).__name__ == "Float8Linear"
    assert fp8.state_dict().keys() == plain.state_dict().keys()  # names, and so checkpoints
    assert all(t.dtype == torch.float32 for t in fp8.state_dict().values())  # high precision
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    ref, got = plain(x), fp8(x)
    # e4m3 keeps 3 mantissa bits: a relative error of a few percent on the logits
    assert (got - ref).abs().max() / ref.abs().max() < 0.1
    assert apply_float8(plain, Float8Recipe.OFF, emulate=True) == ()


def test_without_torchao_the_recipe_is_refused_naming_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    problem = float8_problem(Float8Recipe.TENSORWISE, torch.device("cpu"))
    assert problem is not None and "'fp8' extra" in problem and "train.float8" in problem
    assert float8_problem(Float8Recipe.OFF, torch.device("cpu")) is None


@pytest.mark.parametrize(("capability", "refused"), [((8, 0), True), ((8, 9), False),
                                                     ((9, 0), False)])  # fmt: skip
def test_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch, capability, refused):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    problem = float8_problem(Float8Recipe.ROWWISE, torch.device("cuda", 0))
    assert (problem is not None) is refused
    if refused:
        assert f"{capability[0]}.{capability[1]}" in problem and "8.9" in problem
        with pytest.raises(ConfigError, match=r"train\.float8"):
            float8_start_line(Float8Recipe.ROWWISE, DENSE, torch.device("cuda", 0))


def test_fp8_with_a_vision_language_model_is_refused_by_name(tmp_path):
    from forge.config import load_config

    path = tmp_path / "c.toml"
    path.write_text('[model]\ndim = 64\nn_heads = 4\nn_layers = 2\nvlm = "joint_decoder"\n'
                    '[data]\npath = "x"\n[train]\nfloat8 = "rowwise"\n')  # fmt: skip
    with pytest.raises(ConfigError, match=r"train\.float8: is not supported with model\.vlm"):
        load_config([str(path)])


@pytest.mark.parametrize(
    ("train", "named"),
    [
        ({"float8_check": 10}, "train.float8_check"),  # compares FP8 with nothing: FP8 is off
        ({"float8": "rowwise", "float8_check": -1}, "train.float8_check"),
        ({"float8": "rowwise", "float8_check_tolerance": float("nan")}, "train.float8_check_tolerance"),
        ({"float8": "rowwise", "float8_check": 10, "float8_check_grad_tolerance": 0.0}, "train.float8_check_grad_tolerance"),
        ({"float8_on_drift": "stop"}, "train.float8_on_drift"),  # inert with FP8 off
        ({"float8_check_tolerance": 0.1}, "train.float8_check_tolerance"),
        ({"float8": "rowwise", "float8_on_drift": "stop"}, "train.float8_on_drift"),  # no step checked
        ({"float8": "rowwise", "float8_check_tolerance": 0.1}, "train.float8_check_tolerance"),
        ({"float8": "rowwise", "float8_check": 10, "float8_on_drift": "stop"}, None),
    ],
)  # fmt: skip
def test_the_drift_guards_keys_are_refused_by_name(train, named):
    from forge.config.loader import structure_config

    if named is None:
        assert structure_config({"train": train}).train.float8_check == 10
        return
    with pytest.raises(ConfigError) as err:
        structure_config({"train": train})
    assert [line.split(":")[0] for line in err.value.lines] == [named]


def test_fp8_that_would_cover_no_layer_is_refused_by_name():
    """dim 120: every projection has a dimension that is no multiple of 16."""
    inert = attrs.evolve(DENSE, dim=120, n_heads=4)
    assert float8_layers(inert).converted == ()
    with pytest.raises(ConfigError, match=r"train\.float8='rowwise': no linear layer"):
        float8_start_line(Float8Recipe.ROWWISE, inert, torch.device("cpu"))
    assert float8_start_line(Float8Recipe.ROWWISE, DENSE, torch.device("cpu")) is not None


def test_the_start_line_says_the_weights_are_gathered_in_fp8():
    layers = float8_layers(ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=256))
    line = layers.describe(Float8Recipe.TENSORWISE, emulated=False, gathered=True)
    assert "(their weights gathered in FP8 by FSDP2)" in line
    assert "gathered" not in layers.describe(Float8Recipe.TENSORWISE, emulated=False)


def test_the_overrides_forge_gives_to_resume_without_fp8_are_accepted(tmp_path):
    """What the drift guard's stop and fallback lines say to resume with: on a config whose
    guard stopped the run, those overrides (on the command line, as typed) load."""
    from forge.config.loader import load_config
    from forge.config.train import FLOAT8_OFF

    path = tmp_path / "c.toml"
    path.write_text('[data]\npath = "x"\n[train]\nfloat8 = "rowwise"\nfloat8_check = 10\n'
                    'float8_on_drift = "stop"\n')  # fmt: skip
    overrides = [a for a in FLOAT8_OFF.split() if a.startswith("--")]
    resumed = load_config([str(path), *overrides]).config.train
    assert resumed.float8.value == "off" and resumed.float8_check == 0
