"""forge ↔ transformers: logits, a save_pretrained round trip, greedy generation, RoPE kinds."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from forge.config import ModelConfig
from forge.config.sections import MoeRouter
from forge.interop.export import ExportError, TokenizerInfo, export_model
from forge.interop.hf_import import import_model
from forge.model.generate import sample
from forge.model.transformer import Transformer

transformers = pytest.importorskip("transformers")  # in the dev extra: runs in `make test`

CFG = ModelConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, rope_theta=500000.0
)  # GQA, and a RoPE base that a reader must not drop
TOKENS = TokenizerInfo(bos_id=256, eos_id=257, pad_id=258, kind="byte")


def exported(tmp_path, cfg: ModelConfig = CFG):
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # larger weights than init, so that the logits differ by token
        for p in model.parameters():
            p.mul_(3.0)
    export_model(model.state_dict(), cfg, tmp_path / "exp", "float32", TOKENS)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exp").eval()
    return model, hf


@torch.no_grad()
def test_the_export_loads_into_llama_with_the_same_logits(tmp_path):
    model, hf = exported(tmp_path)
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hf(x).logits, model(x), atol=1e-4, rtol=1e-4)
    assert hf.config.bos_token_id == 256 and hf.generation_config.eos_token_id == 257


@torch.no_grad()
def test_a_save_pretrained_round_trip_imports_to_the_same_logits(tmp_path):
    """transformers v5 writes RoPE's base under rope_parameters: the import reads it there."""
    model, hf = exported(tmp_path)
    hf.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "rope_theta" not in saved or saved["rope_parameters"]["rope_theta"] == 500000.0
    cfg, state = import_model(tmp_path / "saved")
    assert cfg.rope_theta == 500000.0 and cfg.kv_heads == 2
    back = Transformer(cfg).eval()
    back.load_state_dict(state)
    x = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(back(x), model(x), atol=1e-6, rtol=1e-6)


def test_greedy_generation_equals_hf_generate(tmp_path):
    model, hf = exported(tmp_path)
    prompt = [256, 10, 20, 30, 40]
    ours = sample(model, prompt, 24, temperature=0, stop_id=257)
    theirs = hf.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=24, eos_token_id=257
    )[0].tolist()
    assert ours == theirs
    assert len(set(ours[len(prompt) :])) > 1  # not one token repeated: a real comparison


@pytest.mark.parametrize(
    "change,line",
    [
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
            "RoPE type 'linear' (rope scaling) is not implemented by forge",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            "RoPE type 'yarn' (rope scaling) is not implemented by forge",
        ),
        ({"attention_bias": True}, "attention or MLP biases; forge's decoder has none"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'; forge uses 'silu'"),
        (  # a head size of its own, which the weights do not have
            {"head_dim": 8},
            "model.layers.0.self_attn.q_proj.weight: shape [64, 64], config.json implies [32, 64]",
        ),
    ],
)
def test_llama_features_forge_lacks_are_refused_on_import(tmp_path, change, line):
    exported(tmp_path)
    path = tmp_path / "exp" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ExportError) as info:
        import_model(tmp_path / "exp")
    assert len(info.value.lines) == 1 and line in info.value.lines[0]


def test_tied_embeddings_round_trip(tmp_path):
    model, hf = exported(tmp_path, attrs.evolve(CFG, tie_embeddings=True))
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-4, rtol=1e-4)


TEXT = "def héllo(wörld):\n\treturn '🙂' * 2  \r\n"


def test_a_byte_tokenizer_export_loads_with_auto_tokenizer_and_the_same_ids(tmp_path):
    from forge.data.tokenizer import ByteTokenizer

    exported(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "exp")
    ours = ByteTokenizer()
    assert tok.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    ids = ours.encode(TEXT, bos=True, eos=True)
    assert tok.decode(ids, skip_special_tokens=True) == ours.decode(ids) == TEXT


def test_pipeline_text_generation_runs_on_the_export_like_forge(tmp_path):
    from forge.data.tokenizer import ByteTokenizer

    model, _ = exported(tmp_path)
    generate = transformers.pipeline("text-generation", model=str(tmp_path / "exp"))
    out = generate("def ", do_sample=False, max_new_tokens=12, return_full_text=False)
    ours = ByteTokenizer()
    ids = sample(model, ours.encode("def "), 12, temperature=0, stop_id=257)
    assert out[0]["generated_text"] == ours.decode(ids[4:])


MIXTRAL = ModelConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, rope_theta=1e6,
    moe_num_experts=4, moe_top_k=2, moe_hidden_dim=48,
)  # fmt: skip


@torch.no_grad()
def test_a_softmax_mixture_of_experts_exports_to_mixtral_with_the_same_logits(tmp_path):
    torch.manual_seed(0)
    model = Transformer(MIXTRAL).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    export_model(model.state_dict(), MIXTRAL, tmp_path / "exp", "float32", TOKENS)
    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "exp").eval()
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    logits, _ = model(x)
    torch.testing.assert_close(hf(x).logits, logits, atol=1e-4, rtol=1e-4)
    ours = sample(model, [256, 10, 20, 30], 16, temperature=0)
    theirs = hf.generate(torch.tensor([[256, 10, 20, 30]]), do_sample=False, max_new_tokens=16)
    assert ours == theirs[0].tolist()


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"moe_router": MoeRouter.SIGMOID}, "model.moe_router='sigmoid': MixtralForCausalLM"),
        ({"moe_shared_experts": 1}, "model.moe_shared_experts: MixtralForCausalLM has no shared"),
        ({"moe_routed_scale": 2.5}, "model.moe_routed_scale=2.5: MixtralForCausalLM weighs"),
        ({"moe_first_dense": 1}, "model.moe_first_dense / model.moe_every: MixtralForCausalLM"),
        ({"moe_every": 2}, "model.moe_first_dense / model.moe_every: MixtralForCausalLM"),
    ],
)
def test_other_routers_are_refused_by_export_in_one_line(tmp_path, change, fragment):
    cfg = attrs.evolve(MIXTRAL, **change)
    model = Transformer(cfg)
    with pytest.raises(ExportError) as info:
        export_model(model.state_dict(), cfg, tmp_path / "exp", "float32", TOKENS)
    assert len(info.value.lines) == 1 and fragment in info.value.lines[0]
    assert not (tmp_path / "exp").exists() and not (tmp_path / "exp.tmp").exists()


def test_a_mixtral_export_imports_back_to_the_same_weights(tmp_path):
    torch.manual_seed(0)
    model = Transformer(MIXTRAL)
    export_model(model.state_dict(), MIXTRAL, tmp_path / "exp", "float32", TOKENS)
    cfg, state = import_model(tmp_path / "exp")
    assert (cfg.moe_num_experts, cfg.moe_top_k, cfg.expert_hidden_dim) == (4, 2, 48)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
