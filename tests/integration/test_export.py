"""Export to safetensors + Llama config.json and back, with identical logits."""

import json
import subprocess
import sys

import attrs
import pytest
import tomli
import torch

from forge.checkpoint.export import ExportError, export_model, forge_name, hf_name, import_model
from forge.config import ModelConfig
from forge.config.loader import CONVERTER
from forge.model.transformer import Transformer
from tests.conftest import REPO

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


@pytest.mark.parametrize("tied", [False, True])
def test_fp32_export_reloads_with_identical_logits(tmp_path, tied):
    import attrs

    cfg = attrs.evolve(CFG, tie_embeddings=tied)
    torch.manual_seed(0)
    model = Transformer(cfg)
    export_model(model.state_dict(), cfg, tmp_path / "exp", "float32")
    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    cfg2, state = import_model(tmp_path / "exp")
    assert cfg2.hidden_dim == cfg.hidden_dim and cfg2.kv_heads == 2 and cfg2.tie_embeddings is tied
    back = Transformer(cfg2)
    back.load_state_dict(state)
    x = torch.randint(0, 259, (2, 16))
    assert torch.equal(model(x), back(x))


def test_bf16_export_holds_bf16_rounded_weights(tmp_path):
    torch.manual_seed(0)
    model = Transformer(CFG)
    export_model(model.state_dict(), CFG, tmp_path / "exp", "bfloat16")
    _, state = import_model(tmp_path / "exp")
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor.to(torch.bfloat16).float()), name


@pytest.mark.parametrize(
    "ours,theirs",
    [
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("layers.3.attention.wk.weight", "model.layers.3.self_attn.k_proj.weight"),
        ("layers.0.feed_forward.w1.weight", "model.layers.0.mlp.gate_proj.weight"),
        ("layers.1.ffn_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
        ("output.weight", "lm_head.weight"),
    ],
)
def test_names_map_both_ways(ours, theirs):
    assert hf_name(ours) == theirs and forge_name(theirs) == ours


def test_unknown_tensor_is_a_clear_error():
    with pytest.raises(ExportError, match="not part of a Llama model"):
        forge_name("model.layers.0.mlp.experts.0.w1.weight")


def test_convert_script_round_trip_through_a_run(tiny_config, tmp_path):
    """train -> export -> import -> the imported checkpoint serves as checkpoint.load_path."""
    from tests.e2e.test_train_script import TRAIN, run_dir

    assert TRAIN.main([str(tiny_config), "--train.max_steps=3"]) == 0
    script = [sys.executable, str(REPO / "scripts" / "convert_checkpoint.py")]
    out = subprocess.run(
        [
            *script,
            "export",
            str(run_dir(tiny_config)),
            "--out",
            str(tmp_path / "exp"),
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [*script, "import", str(tmp_path / "exp"), "--out", str(tmp_path / "imported")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    from forge.checkpoint.store import load_checkpoint
    from forge.config import load_config

    cfg = load_config([str(tiny_config)]).config.model
    # the printed [model] section is complete: it loads back to the same config
    section = out.stdout[out.stdout.index("\n[model]") :]
    parsed = CONVERTER.structure(tomli.loads(section)["model"], ModelConfig)
    assert parsed.hidden_dim == cfg.hidden_dim  # the export states the FFN width explicitly
    assert attrs.evolve(parsed, ffn_hidden_dim=cfg.ffn_hidden_dim) == cfg
    # the byte tokenizer's ids reach config.json and generation_config.json
    exported = json.loads((tmp_path / "exp" / "config.json").read_text())
    generation = json.loads((tmp_path / "exp" / "generation_config.json").read_text())
    for doc in (exported, generation):
        assert (doc["bos_token_id"], doc["eos_token_id"], doc["pad_token_id"]) == (256, 257, 258)
    trained, imported = Transformer(cfg), Transformer(cfg)
    load_checkpoint(run_dir(tiny_config) / "checkpoints" / "step_3", trained, None)
    load_checkpoint(tmp_path / "imported" / "step_0", imported, None)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(imported.state_dict()[name], tensor), name
    fresh = tmp_path / "fresh.toml"
    fresh.write_text(
        tiny_config.read_text().replace(str(run_dir(tiny_config)), str(tmp_path / "run2"))
    )
    load = f"--checkpoint.load_path={tmp_path / 'imported' / 'step_0'}"
    assert TRAIN.main([str(fresh), load, "--train.max_steps=3"]) == 0
    first_new = json.loads((tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()[0])
    first_old = json.loads((run_dir(tiny_config) / "metrics.jsonl").read_text().splitlines()[0])
    assert first_new["loss"] < first_old["loss"]  # same first batch, trained initial weights


def test_a_qk_norm_model_is_refused_by_export_in_one_line(tmp_path):
    from forge.checkpoint.export import ExportError

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, max_seq_len=16, qk_norm=True)
    state = Transformer(cfg).state_dict()
    with pytest.raises(ExportError) as info:
        export_model(state, cfg, tmp_path / "out", "float32")
    assert info.value.lines == [
        "model.qk_norm: transformers' LlamaForCausalLM has no query/key norms, so this model "
        "has no Llama export; train without qk_norm to export it"
    ]
    assert not (tmp_path / "out").exists()
