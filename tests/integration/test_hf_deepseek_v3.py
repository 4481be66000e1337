"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) against transformers itself, nothing downloaded:
tiny random models that transformers builds and saves with ``save_pretrained`` import with its
logits and greedy text; forge models with latent attention, experts and multi-token depths
export to folders transformers loads with forge's logits and import back bit for bit, depths
included; a depth's layer in DeepSeek's naming computes forge's depth; what forge cannot
compute exactly is refused in one line naming the key."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

from forge.config import ModelConfig
from forge.config.latent import LatentConfig
from forge.config.model import MoeRouter
from forge.interop.export import export_model
from forge.interop.export_rules import export_family, export_problem
from forge.interop.families import DEEPSEEK_V3
from forge.interop.hf_import import import_model
from forge.model.generate import sample
from forge.model.moe import empty_stats
from forge.model.transformer import Transformer
from tests.e2e.test_train_script import load_script
from tests.integration.test_hf_families import (
    config_change,
    forge_model,
    logits,
    safetensors_of,
)

transformers = pytest.importorskip("transformers")  # in the dev extra: runs in `make test`

CONVERT = load_script("convert_checkpoint")
SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 300,
    "max_position_embeddings": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
}
# Llama 3.1's scaling on the rotated channels: with 8 of them and base 100 the wavelengths
# (6.3, 20, 63, 200) fall in all three of its bands at an original context of 32
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 100.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
FOLDERS = {
    "q_rank, groups, shared, first dense": {
        "q_lora_rank": 24,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
    },
    "full query, one group, no shared, no dense": {
        "q_lora_rank": None,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 0,
        "first_k_dense_replace": 0,
        "routed_scaling_factor": 1.0,
    },
    "halves (rope_interleave false), llama3 RoPE, tied": {
        "q_lora_rank": 24,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 2,
        "first_k_dense_replace": 2,
        "rope_interleave": False,
        "rope_parameters": LLAMA3_ROPE,
        "tie_word_embeddings": True,
    },
}
FIRST = next(iter(FOLDERS))
TOKENS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
PROMPT = [5, 10, 20, 30]


def hf_model(keys: dict[str, Any]) -> Any:
    """transformers' model with random weights large enough that the logits differ by token,
    and a score-correction bias that moves the routing."""
    config = transformers.DeepseekV3Config(**(SHAPE | keys))
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else 0.15 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    return model


@pytest.fixture(scope="module", params=list(FOLDERS), ids=list(FOLDERS))
def saved(request, tmp_path_factory) -> tuple[dict[str, Any], Any, pathlib.Path]:
    """(the keys, transformers' model, the folder its ``save_pretrained`` wrote)."""
    keys = FOLDERS[request.param]
    model = hf_model(keys)
    folder = tmp_path_factory.mktemp("deepseek_v3") / "hf"
    model.save_pretrained(folder)
    return keys, model, folder


@torch.no_grad()
def test_an_import_has_transformers_logits_and_greedy_text(saved):
    keys, hf, folder = saved
    model = forge_model(folder)
    assert export_family(model.cfg) is DEEPSEEK_V3
    difference = (logits(model, TOKENS) - hf(TOKENS).logits).abs().max().item()
    name = next(n for n, k in FOLDERS.items() if k is keys)
    print(f"deepseek_v3, {name}: max |forge - transformers| logit = {difference:.3g}")
    assert difference <= 1e-4
    ours = sample(model, PROMPT, 12, temperature=0)
    expected = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12)
    assert ours == expected[0].tolist()
    assert len(set(ours[len(PROMPT) :])) > 2  # not one token repeated: a real comparison


@torch.no_grad()
def test_the_rope_pairs_the_correction_bias_and_the_scaling_are_exercised(tmp_path):
    """Reading the interleaved rows as halves, dropping the score-correction bias or the
    llama3 RoPE scaling moves the logits: the test folders exercise all three."""
    hf = hf_model(FOLDERS[FIRST])
    hf.save_pretrained(tmp_path / "hf")
    model = forge_model(tmp_path / "hf")
    assert model.cfg.mla is not None and model.cfg.mla.q_rank == 24
    theirs = hf(TOKENS).logits
    assert (logits(model, TOKENS) - theirs).abs().max() <= 1e-4
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"rope_interleave": False}))
    assert (logits(forge_model(tmp_path / "hf"), TOKENS) - theirs).abs().max() > 1e-2
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            assert b.abs().max() > 0  # imported, not the softmax families' zero
            b.zero_()
    assert (logits(model, TOKENS) - theirs).abs().max() > 1e-2
    scaled = hf_model(FOLDERS["halves (rope_interleave false), llama3 RoPE, tied"])
    scaled.save_pretrained(tmp_path / "scaled")
    model = forge_model(tmp_path / "scaled")
    assert model.cfg.rope_scaling is not None  # and it matters:
    plain = Transformer(attrs.evolve(model.cfg, rope_scaling=None)).eval()
    plain.load_state_dict(model.state_dict())
    assert (logits(plain, TOKENS) - scaled(TOKENS).logits).abs().max() > 1e-2


@torch.no_grad()
def test_an_export_loads_in_transformers_with_the_same_logits_and_tensors(saved, tmp_path):
    keys, hf, folder = saved
    model = forge_model(folder)
    export_model(model.state_dict(), model.cfg, tmp_path / "exp", "float32")
    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["rope_interleave"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exp").eval()
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    torch.testing.assert_close(back(TOKENS).logits, hf(TOKENS).logits, atol=1e-6, rtol=0)
    written, original = safetensors_of(tmp_path / "exp"), safetensors_of(folder)
    assert written.keys() == original.keys()  # zero-wide shared experts and a tied head alike
    if keys.get("rope_interleave", True):  # else the export interleaves the rotated rows
        assert all(torch.equal(written[k], original[k]) for k in original)
    assert import_model(tmp_path / "exp")[0] == model.cfg


BASE = ModelConfig(
    dim=64,
    n_layers=3,
    n_heads=4,
    vocab_size=300,
    max_seq_len=64,
    ffn_hidden_dim=96,
    norm_eps=1e-6,
    mla=LatentConfig(kv_rank=16, q_rank=24, nope_dim=8, rope_dim=8, v_dim=12),
    moe_num_experts=8,
    moe_top_k=2,
    moe_hidden_dim=32,
    moe_router=MoeRouter.SIGMOID,
)
# models born in forge, with multi-token depths (which transformers' own save has none of)
NATIVE = {
    "q_rank, 2 MoE depths, shared, groups, first dense": attrs.evolve(
        BASE,
        moe_shared_experts=1,
        moe_first_dense=1,
        moe_num_groups=4,
        moe_top_groups=2,
        moe_routed_scale=2.5,
        mtp_depth=2,
        mtp_moe=True,
    ),
    "full query, a dense depth, no shared, no dense block": attrs.evolve(
        BASE, mla=attrs.evolve(BASE.mla, q_rank=0), mtp_depth=1
    ),
    "tied, a MoE depth without shared experts, 2 dense blocks": attrs.evolve(
        BASE, tie_embeddings=True, moe_first_dense=2, mtp_depth=1, mtp_moe=True
    ),
}


def native(cfg: ModelConfig) -> Transformer:
    """A forge model with weights larger than init (logits that differ by token) and a
    balancing bias that moves the routing."""
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.2 * torch.randn(b.shape))
    return model


@pytest.mark.parametrize("cfg", list(NATIVE.values()), ids=list(NATIVE))
@torch.no_grad()
def test_a_forge_model_with_depths_round_trips_bit_for_bit(cfg, tmp_path):
    model = native(cfg)
    export_model(model.state_dict(), cfg, tmp_path / "exp", "float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exp").eval()
    torch.testing.assert_close(hf(TOKENS).logits, logits(model, TOKENS), atol=1e-4, rtol=1e-4)
    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == cfg.mtp_depth
    written = safetensors_of(tmp_path / "exp")
    depth = f"model.layers.{cfg.n_layers}"  # depth 1's layer, in DeepSeek's naming
    ours = model.state_dict()
    proj = ours["mtp.1.proj.weight"]
    assert torch.equal(written[f"{depth}.eh_proj.weight"], proj.roll(cfg.dim, 1))  # emb first
    assert torch.equal(written[f"{depth}.embed_tokens.weight"], ours["tok_embeddings.weight"])
    assert torch.equal(written[f"{depth}.shared_head.head.weight"], ours["output.weight"])
    assert (f"{depth}.mlp.gate.e_score_correction_bias" in written) is cfg.mtp_moe
    back, state = import_model(tmp_path / "exp")
    assert back == cfg
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_a_bfloat16_export_keeps_the_correction_bias_in_float32(tmp_path):
    """The bias moves in steps of ~1e-3, and forge keeps it fp32 in a bf16 model: the export
    writes it so (as the release stores it), and it reads back bit for bit."""
    cfg = NATIVE["q_rank, 2 MoE depths, shared, groups, first dense"]
    model = native(cfg)
    export_model(model.state_dict(), cfg, tmp_path / "exp", "bfloat16")
    written = safetensors_of(tmp_path / "exp")
    bias = written["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and written["model.layers.1.mlp.gate.weight"].dtype == (
        torch.bfloat16
    )
    _, state = import_model(tmp_path / "exp")
    for name, value in model.state_dict().items():
        if name.endswith("expert_bias"):
            assert torch.equal(state[name], value), name


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def test_a_depth_layer_in_deepseeks_naming_computes_forges_depth(tmp_path):
    """DeepSeek-V3's depth from the exported tensors alone: eh_proj(concat(enorm(embedding of
    token i + k), hnorm(h))), transformers' own decoder layer (the folder loaded with its
    depth layers counted as blocks), shared_head.norm and shared_head.head; the logits of
    each depth equal forge's."""
    cfg = NATIVE["q_rank, 2 MoE depths, shared, groups, first dense"]
    model = native(cfg)
    export_model(model.state_dict(), cfg, tmp_path / "exp", "float32")
    st = safetensors_of(tmp_path / "exp")
    n, eps, (b, t) = cfg.n_layers, cfg.norm_eps, TOKENS.shape
    blocks = n + cfg.mtp_depth
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "exp", num_hidden_layers=blocks
    )
    positions = torch.arange(t)[None]
    rope = hf.model.rotary_emb(torch.zeros(1, t, cfg.dim), positions)
    h = theirs = model(TOKENS, hidden=True)[0]  # the last block's output, before the final norm
    mask = model.attention_mask(torch.device("cpu"), (b, t), None, None)
    stats = empty_stats(cfg, "cpu")
    embed, head, depths = model.tok_embeddings, model.output, model.mtp
    assert embed is not None and head is not None and depths is not None
    for k in range(1, cfg.mtp_depth + 1):
        tokens = torch.nn.functional.pad(TOKENS[:, k:], (0, k))  # token i + k at position i
        layer = f"model.layers.{n + k - 1}"
        embedded = rms(st[f"{layer}.embed_tokens.weight"][tokens], st[f"{layer}.enorm.weight"], eps)
        joined = torch.cat([embedded, rms(theirs, st[f"{layer}.hnorm.weight"], eps)], dim=-1)
        x = joined @ st[f"{layer}.eh_proj.weight"].T
        theirs = hf.model.layers[n + k - 1](x, position_embeddings=rope, position_ids=positions)
        normed = rms(theirs, st[f"{layer}.shared_head.norm.weight"], eps)
        reference = normed @ st[f"{layer}.shared_head.head.weight"].T
        depth = depths[str(k)]
        h, ours, stats = depth(h, embed(tokens), model.rope_cos, model.rope_sin, mask, None, stats)
        difference = (head(ours) - reference).abs().max().item()
        print(f"deepseek_v3 depth {k}: max |forge - DeepSeek's form| logit = {difference:.3g}")
        assert difference <= 1e-4


def test_the_model_section_the_import_prints_loads_back(tmp_path):
    """The [model] section the import prints ([model.mla] a table) loads back as the import."""
    import tomli

    from forge.config.loader import CONVERTER

    hf_model(FOLDERS[FIRST]).save_pretrained(tmp_path / "hf")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert CONVERT.main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert "(a DeepSeek-V3 model)" in out.getvalue()
    section = tomli.loads(out.getvalue()[out.getvalue().index("\n[model]") :])["model"]
    assert "mla" in section and section["moe_router"] == "sigmoid"
    assert CONVERTER.structure(section, ModelConfig) == import_model(tmp_path / "hf")[0]


def test_continued_pre_training_carries_the_correction_bias_and_the_depth(tiny_config, tmp_path):
    """docs/interop.md's workflow on a DeepSeek-V3 folder with a depth (a forge export stands
    in for the release: transformers' own save has no depths): import, train three steps from
    it with the printed [model] section and the balancing bias moving, export. The export holds
    the trained correction biases (forge's expert_bias buffers, saved in its checkpoints) and
    depth, and transformers loads it with the trained model's logits."""
    from tests.e2e.test_train_script import TRAIN, run_dir

    cfg = attrs.evolve(
        BASE, vocab_size=259, max_seq_len=32, moe_first_dense=1, mtp_depth=1, mtp_moe=True
    )
    torch.manual_seed(0)
    released = Transformer(cfg)
    export_model(released.state_dict(), cfg, tmp_path / "released", "float32")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = ["import", str(tmp_path / "released"), "--out", str(tmp_path / "imported")]
        assert CONVERT.main(argv) == 0
    model_section = out.getvalue()[out.getvalue().index("\n[model]") :]
    text = tiny_config.read_text()
    tiny_config.write_text(model_section + "\n" + text[text.index("[train]") :])
    load = f"--checkpoint.load_path={tmp_path / 'imported' / 'step_0'}"
    steps = ["--train.max_steps=3", "--model.moe_bias_update_rate=0.01"]
    steps += ["--checkpoint.export_final=true", "--checkpoint.export_dtype=float32"]
    assert TRAIN.main([str(tiny_config), load, *steps]) == 0
    export = ["export", str(run_dir(tiny_config)), "--out", str(tmp_path / "exp")]
    with contextlib.redirect_stdout(io.StringIO()):
        assert CONVERT.main([*export, "--dtype", "float32"]) == 0
    trained = forge_model(tmp_path / "exp")
    assert trained.cfg == cfg  # the rate is training's, not the model's: not exported
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exp").eval()
    x = TOKENS[:, :32] % 259
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, logits(trained, x), atol=1e-4, rtol=1e-4)
    before, after = safetensors_of(tmp_path / "released"), safetensors_of(tmp_path / "exp")
    for layer in (1, 2, 3):  # the model's mixtures of experts, then the depth's
        bias = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        assert not torch.equal(after[bias], before[bias]), bias
    depth = "model.layers.3.eh_proj.weight"
    assert not torch.equal(after[depth], before[depth])
    final = safetensors_of(run_dir(tiny_config) / "export")  # checkpoint.export_final's
    assert final.keys() == after.keys() and all(torch.equal(final[k], after[k]) for k in after)


# --- refusals: convert_checkpoint.py import on a copy of a valid folder with one thing
# changed: exit 2, one ``error:`` line naming the key, nothing written


def tensor_change(name: str, change: Callable[[torch.Tensor], torch.Tensor | None]):
    """model.safetensors with one tensor changed (None: dropped)."""

    def apply(folder: pathlib.Path) -> None:
        from safetensors.torch import save_file

        state = safetensors_of(folder)
        value = change(state.pop(name))
        if value is not None:
            state[name] = value
        save_file(state, str(folder / "model.safetensors"))

    return apply


YARN = {  # DeepSeek-V3's released rope_scaling, at a tiny context
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 32,
}
DEPTH = "model.layers.3"  # the depth's layer of the exported folder (3 blocks)
# (case, folder: "hf" transformers' save or "depths" a forge export with one depth, change,
# a fragment of the one error line)
REFUSED = [
    ("YaRN RoPE (the release's)", "hf", config_change({"rope_parameters": YARN}), "RoPE type 'yarn' (rope scaling) is not implemented by forge"),
    ("norm_topk_prob false", "hf", config_change({"norm_topk_prob": False}), "norm_topk_prob false: the chosen experts' weights are not renormalised"),
    ("rms_norm_eps other than 1e-6", "hf", config_change({"rms_norm_eps": 1e-5}), "rms_norm_eps 1e-05: DeepseekV3ForCausalLM normalises the latents (q_a_layernorm, kv_a_layernorm) with eps 1e-6"),
    ("key/value heads other than the heads", "hf", config_change({"num_key_value_heads": 2}), "num_key_value_heads 2: latent attention expands keys and values for every head"),
    ("groups that do not split the experts", "hf", config_change({"n_group": 3}), "gives model.moe_num_groups must split model.moe_num_experts=8"),
    ("no mixture-of-experts block", "hf", config_change({"first_k_dense_replace": 3}), "gives model.moe_first_dense leaves no mixture-of-experts block"),
    ("shared experts as a string", "hf", config_change({"n_shared_experts": "1"}), "n_shared_experts: expected an integer, got '1'"),
    ("negative shared experts", "hf", config_change({"n_shared_experts": -1}), "n_shared_experts: must be >= 0, got -1"),
    ("attention biases", "hf", config_change({"attention_bias": True}), "attention or MLP biases"),
    ("a depth's head not the model's", "depths", tensor_change(f"{DEPTH}.shared_head.head.weight", lambda w: w + 1), f"{DEPTH}.shared_head.head.weight differs from lm_head.weight; forge's multi-token depths share the model's embedding and output head"),
    ("a depth's embedding not the model's", "depths", tensor_change(f"{DEPTH}.embed_tokens.weight", lambda w: w * 2), f"{DEPTH}.embed_tokens.weight differs from model.embed_tokens.weight"),
    ("more depths declared than held", "depths", config_change({"num_nextn_predict_layers": 2}), "num_nextn_predict_layers is 2 but the weights hold 1 layer after the model's 3"),
    ("a depth without its projection", "depths", tensor_change(f"{DEPTH}.eh_proj.weight", lambda w: None), f"missing 1 tensor config.json implies ({DEPTH}.eh_proj.weight)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, pathlib.Path]:
    """transformers' save of the first folder's model, and a forge export with one depth."""
    root = tmp_path_factory.mktemp("refused")
    hf_model(FOLDERS[FIRST]).save_pretrained(root / "hf")
    cfg = attrs.evolve(BASE, moe_first_dense=1, mtp_depth=1, mtp_moe=True)
    export_model(native(cfg).state_dict(), cfg, root / "depths", "float32")
    return {"hf": root / "hf", "depths": root / "depths"}


@pytest.mark.parametrize(
    ("kind", "change", "fragment"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_what_forge_cannot_compute_exactly_is_refused_in_one_line(
    folders, tmp_path, kind, change, fragment
):
    folder = tmp_path / "hf"
    shutil.copytree(folders[kind], folder)
    change(folder)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = CONVERT.main(["import", str(folder), "--out", str(tmp_path / "imported")])
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], err.getvalue()
    assert code == 2 and "Traceback" not in err.getvalue()
    assert not (tmp_path / "imported").exists()


EXPORT_REFUSED = [
    ("a softmax router", attrs.evolve(BASE, moe_router=MoeRouter.SOFTMAX), "model.moe_router='softmax': DeepseekV3ForCausalLM routes by a sigmoid of each expert's score"),
    ("dense", attrs.evolve(BASE, moe_num_experts=0), "model.moe_num_experts=0: DeepseekV3ForCausalLM's blocks after first_k_dense_replace are mixtures of experts"),
    ("experts every other block", attrs.evolve(BASE, moe_every=2), "model.moe_every=2: DeepseekV3ForCausalLM has experts in every block"),
    ("another norm eps", attrs.evolve(BASE, norm_eps=1e-5), "model.norm_eps=1e-05: DeepseekV3ForCausalLM normalises the latents with eps 1e-6"),
    ("depths without latent attention", attrs.evolve(BASE, mla=None, moe_router=MoeRouter.SOFTMAX, mtp_depth=1), "model.mtp_depth=1: MixtralForCausalLM has no multi-token prediction layers"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "line"), [r[1:] for r in EXPORT_REFUSED], ids=[r[0] for r in EXPORT_REFUSED]
)
def test_what_deepseek_v3_does_not_hold_is_refused_by_export(cfg, line):
    assert not cfg.problems()
    problem = export_problem(cfg)
    assert problem is not None and problem.startswith(line), problem
