"""Export to safetensors + Llama config.json and back, with identical logits."""

import json
import math
import subprocess
import sys

import attrs
import pytest
import tomli
import torch

from forge.config import ModelConfig
from forge.config.loader import CONVERTER
from forge.interop import families
from forge.interop.export import ExportError, export_model, hf_tensors, llama_config
from forge.interop.export_rules import export_family
from forge.interop.hf_config import hf_config_problems, model_config_from_hf
from forge.interop.hf_files import find_weights, index_problems, read_headers, read_json
from forge.interop.hf_import import (
    dtype_problems,
    finite_problems,
    import_model,
    layer_problem,
    tensor_problems,
)
from forge.interop.hf_json import decode_json
from forge.interop.tensor_names import forge_name, hf_name, hf_shapes
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


def test_an_export_that_computes_otherwise_says_so_at_start_up_and_when_written(
    tiny_config, tmp_path
):
    """A mixture of experts trained with a capacity factor exports as Mixtral, which computes
    every assignment: said when ``checkpoint.export_final`` is asked for and when
    ``convert_checkpoint.py export`` writes it (``export_rules.export_caveats``)."""
    from tests.e2e.test_train_script import TRAIN, load_script, run_dir
    from tests.in_process import run_main

    moe = ["--model.moe_num_experts=4", "--model.moe_top_k=2", "--model.moe_capacity_factor=1.25"]
    said = "warning: checkpoint.export_final: model.moe_capacity_factor=1.25: MixtralForCausalLM"
    trained = run_main(
        TRAIN.main,
        [str(tiny_config), "--train.max_steps=3", "--checkpoint.export_final=true", *moe],
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert said in trained.stdout + trained.stderr
    assert (run_dir(tiny_config) / "export" / "config.json").is_file()  # exported all the same
    convert = load_script("convert_checkpoint").main
    out = run_main(convert, ["export", str(run_dir(tiny_config)), "--out", str(tmp_path / "exp")])
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: model.moe_capacity_factor=1.25: MixtralForCausalLM computes every expert "
        "assignment (dropless), so the export's outputs differ from this model's wherever "
        "capacity drops one"
    ]


@pytest.mark.parametrize(
    ("option", "line"),
    [
        ({"sliding_window": 8}, "model.sliding_window=8: the Llama, Mixtral and Qwen3 exports "
         "attend to the whole context, so this model has no export; train without a window to "
         "export it"),
        ({"qk_norm": True, "sliding_window": 8}, "model.sliding_window=8: the Llama, Mixtral and "
         "Qwen3 exports attend to the whole context"),
    ],
    ids=["sliding_window", "qk_norm and sliding_window"],
)  # fmt: skip
def test_a_model_no_family_holds_is_refused_by_export_in_one_line(tmp_path, option, line):
    from forge.interop.export import ExportError

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, max_seq_len=16, **option)
    state = Transformer(cfg).state_dict()
    with pytest.raises(ExportError) as info:
        export_model(state, cfg, tmp_path / "out", "float32")
    assert len(info.value.lines) == 1 and info.value.lines[0].startswith(line)
    assert not (tmp_path / "out").exists()


# --- the import's checks, as pure functions (tests/e2e/test_hf_import_hostile.py runs the
# script on malformed folders; these tables hold every variant of each check)

LLAMA = llama_config(CFG, "float32")
NAN, INF = math.nan, math.inf

# (case, keys replaced in a valid config.json (``...``: deleted), the one line, or None)
CONFIGS = [
    ("valid", {}, None),
    ("nulls for optional keys", {"num_key_value_heads": None, "head_dim": None, "rope_scaling": None, "rms_norm_eps": None, "max_position_embeddings": None}, None),
    ("an int rope_theta", {"rope_theta": 500000, "rope_parameters": ...}, None),
    ("the largest context", {"max_position_embeddings": 2**32}, None),
    ("swish, HF's other name for silu", {"hidden_act": "swish"}, None),
    ("hidden_size missing", {"hidden_size": ...}, "hidden_size: missing; a Llama config.json states it"),
    ("num_hidden_layers missing", {"num_hidden_layers": ...}, "num_hidden_layers: missing"),
    ("num_attention_heads missing", {"num_attention_heads": ...}, "num_attention_heads: missing"),
    ("vocab_size missing", {"vocab_size": ...}, "vocab_size: missing"),
    ("intermediate_size missing", {"intermediate_size": ...}, "intermediate_size: missing"),
    ("hidden_size a string", {"hidden_size": "32"}, "hidden_size: expected an integer, got '32'"),
    ("hidden_size a float", {"hidden_size": 32.0}, "hidden_size: expected an integer, got 32.0"),
    ("hidden_size a bool", {"hidden_size": True}, "hidden_size: expected an integer, got true"),
    ("hidden_size null", {"hidden_size": None}, "hidden_size: expected an integer, got null"),
    ("hidden_size a list", {"hidden_size": [32]}, "hidden_size: expected an integer, got [32]"),
    ("hidden_size negative", {"hidden_size": -32}, "hidden_size: must be > 0, got -32"),
    ("hidden_size zero", {"hidden_size": 0}, "hidden_size: must be > 0, got 0"),
    ("hidden_size beyond 64 bits", {"hidden_size": 2**64}, "hidden_size: 18446744073709551616 is out of range: must fit in 64 bits (< 2**63)"),
    ("num_hidden_layers zero", {"num_hidden_layers": 0}, "num_hidden_layers: must be > 0, got 0"),
    ("vocab_size NaN", {"vocab_size": NAN}, "vocab_size: expected an integer, got NaN"),
    ("num_key_value_heads zero", {"num_key_value_heads": 0}, "num_key_value_heads: must be > 0, got 0"),
    ("max_position_embeddings zero", {"max_position_embeddings": 0}, "max_position_embeddings: must be > 0, got 0"),
    ("max_position_embeddings past 2**32", {"max_position_embeddings": 2**32 + 1}, "max_position_embeddings: 4294967297 is beyond forge's limit of 2**32 positions"),
    ("head_dim a string", {"head_dim": "8"}, "head_dim: expected an integer, got '8'"),
    ("rms_norm_eps a string", {"rms_norm_eps": "1e-5"}, "rms_norm_eps: expected a number, got '1e-5'"),
    ("rms_norm_eps NaN", {"rms_norm_eps": NAN}, "rms_norm_eps: expected a finite number, got NaN"),
    ("rms_norm_eps zero", {"rms_norm_eps": 0.0}, "rms_norm_eps: must be > 0, got 0.0"),
    ("rope_theta infinite", {"rope_theta": INF, "rope_parameters": ...}, "rope_theta: expected a finite number, got Infinity"),
    ("rope_theta -infinite", {"rope_theta": -INF, "rope_parameters": ...}, "rope_theta: expected a finite number, got -Infinity"),
    ("rope_theta beyond 64 bits", {"rope_theta": 10**30, "rope_parameters": ...}, "rope_theta: 1000000000000000000000000000000 is out of range: must be < 2**63"),
    ("rope_parameters.rope_theta negative", {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_parameters.rope_theta: must be > 0, got -1.0"),
    ("rope_parameters a list", {"rope_parameters": [1]}, "rope_parameters: expected a JSON object, got [1]"),
    ("rope_scaling a string", {"rope_scaling": "linear"}, "rope_scaling: expected a JSON object, got 'linear'"),
    ("initializer_range a string", {"initializer_range": "x"}, "initializer_range: expected a number, got 'x'"),
    ("tie_word_embeddings a string", {"tie_word_embeddings": "yes"}, "tie_word_embeddings: expected true or false, got 'yes'"),
    ("tie_word_embeddings 1", {"tie_word_embeddings": 1}, "tie_word_embeddings: expected true or false, got 1"),
    ("attention_bias a string", {"attention_bias": "no"}, "attention_bias: expected true or false, got 'no'"),
    ("hidden_size not divisible by heads", {"num_attention_heads": 5, "head_dim": ...}, "hidden_size 32 is not divisible by num_attention_heads 5"),
    ("an odd head size", {"hidden_size": 12, "head_dim": ...}, "the head size hidden_size / num_attention_heads = 3 is odd"),
    ("kv heads not dividing heads", {"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ("a head_dim of its own", {"head_dim": 16}, None),
    ("an odd head_dim", {"head_dim": 7}, "head_dim 7 is odd; RoPE rotates pairs of channels"),
    ("llama3 RoPE (v5's rope_parameters)", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}, None),
    ("llama3 RoPE (v4's rope_scaling)", {"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}}, None),
    ("llama3 RoPE without its factor", {"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1, "high_freq_factor": 4}}, "rope_scaling.factor: missing; a 'llama3' RoPE states it"),
    ("llama3 RoPE with a string factor", {"rope_parameters": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1, "high_freq_factor": 4}}, "rope_parameters.factor: expected a number, got '8'"),
    ("llama3 RoPE with a float original context", {"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8.5}}, "rope_scaling.original_max_position_embeddings: expected an integer, got 8.5"),
    ("yarn RoPE", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn' (rope scaling) is not implemented by forge, only plain RoPE ('default') and Llama 3.1's ('llama3')"),
    ("dynamic RoPE", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic' (rope scaling) is not implemented by forge"),
    ("partial rotary", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5: forge rotates every channel of a head"),
    ("a sliding window in layer_types", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types [\"full_attention\", \"sliding_attention\"]: forge's blocks all attend to the whole context"),
    ("model_type missing", {"model_type": ...}, "model_type: missing; forge imports DeepSeek-V3, Llama, Mixtral, Qwen3 and Qwen3-MoE models (model_type 'deepseek_v3', 'llama', 'mixtral', 'qwen3', 'qwen3_moe')"),
    ("another model_type", {"model_type": "gpt2"}, "model_type 'gpt2': forge imports DeepSeek-V3, Llama, Mixtral, Qwen3 and Qwen3-MoE models (model_type 'deepseek_v3', 'llama', 'mixtral', 'qwen3', 'qwen3_moe') only"),
    ("model_type a number", {"model_type": 7}, "model_type 7: forge imports DeepSeek-V3, Llama, Mixtral, Qwen3 and Qwen3-MoE models"),
    ("another architecture", {"architectures": ["GPT2LMHeadModel"]}, "architectures [\"GPT2LMHeadModel\"]: forge imports model_type 'llama' as LlamaForCausalLM only"),
    ("architectures a string", {"architectures": "LlamaForCausalLM"}, "architectures: expected a list of class names, got 'LlamaForCausalLM'"),
    ("Mixtral's model_type on Llama's architecture", {"num_local_experts": 8, "model_type": "mixtral"}, "architectures [\"LlamaForCausalLM\"]: forge imports model_type 'mixtral' as MixtralForCausalLM only"),
    ("rope scaling", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE type 'linear' (rope scaling) is not implemented by forge"),
    ("biases", {"mlp_bias": True}, "attention or MLP biases; forge's decoder has none"),
    ("another activation", {"hidden_act": "gelu"}, "hidden_act 'gelu'; forge uses 'silu'"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "line"), [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_hf_config_problems_names_the_key_in_one_line(change, line):
    config = dict(LLAMA)
    for key, value in change.items():
        config.pop(key) if value is ... else config.__setitem__(key, value)
    problems = hf_config_problems(json.loads(json.dumps(config)), "hf/config.json")
    if line is None:
        assert problems == []
        model_config_from_hf(config)  # and it builds a ModelConfig
    else:
        assert len(problems) == 1 and problems[0].startswith(f"hf/config.json: {line}"), problems


@pytest.mark.parametrize(
    ("config", "line"),
    [
        ([1, 2], "config.json: expected a JSON object ({...}), got a list"),
        (None, "config.json: expected a JSON object ({...}), got null"),
        ("llama", "config.json: expected a JSON object ({...}), got a string"),
        (3, "config.json: expected a JSON object ({...}), got a number"),
    ],
)
def test_a_config_json_that_is_no_object_is_one_line(config, line):
    assert hf_config_problems(config) == [line]
    with pytest.raises(ExportError) as info:
        model_config_from_hf(config)
    assert info.value.lines == [line]


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b'{"a": 1}', None),
        (b'\xef\xbb\xbf{"a": 1}', None),  # a UTF-8 byte order mark is read past
        (b"", "not JSON (the file is empty)"),
        (b" \n", "not JSON (the file is empty)"),
        (
            b"{a: 1}",
            "not JSON (Expecting property name enclosed in double quotes at line 1 column 2)",
        ),
        (b'{"a": "caf\xe9"}', "not UTF-8 (byte 0xe9 at offset 10); save it as UTF-8 JSON"),
        (b"[" * 100_000, "not JSON that can be read (nested too deeply)"),
    ],
)
def test_decode_json_says_why_bytes_are_no_json(data, problem):
    doc, said = decode_json(data)
    assert said == problem
    assert (doc == {"a": 1}) if problem is None else doc is None


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ({"weight_map": {"a": "model-1.safetensors"}}, None),
        ([], "expected a JSON object ({...}), got a list"),
        ({"metadata": {}}, "weight_map: missing"),
        ({"weight_map": {}}, "weight_map: expected an object of tensor name: file name, got an object"),
        ({"weight_map": ["a"]}, "weight_map: expected an object of tensor name: file name, got a list"),
        ({"weight_map": {"a": 7}}, "weight_map['a']: 7 is not a file name in the folder"),
        ({"weight_map": {"a": "../x.safetensors"}}, "weight_map['a']: '../x.safetensors' is not a file name"),
        ({"weight_map": {"a": "/etc/passwd"}}, "weight_map['a']: '/etc/passwd' is not a file name"),
        ({"weight_map": {"a": ".."}}, "weight_map['a']: '..' is not a file name"),
        ({"weight_map": {"a": ""}}, "weight_map['a']: '' is not a file name"),
        ({"weight_map": {"a": "x", "b": "..", "c": "/"}}, "weight_map['b']: '..' is not a file name in the folder and 1 more"),
    ],
)  # fmt: skip
def test_index_problems(doc, problem):
    said = index_problems(doc)
    assert said == [] if problem is None else (len(said) == 1 and said[0].startswith(problem)), said


@pytest.mark.parametrize(
    ("n_layers", "layers", "problem"),
    [
        (2, [0, 1], None),
        (3, [0, 1], "num_hidden_layers is 3 but model.safetensors holds 2 layers (0-1);"),
        (1, [0, 1], "num_hidden_layers is 1 but model.safetensors holds 2 layers (0-1);"),
        (2, [], "num_hidden_layers is 2 but model.safetensors holds 0 layers;"),
        (3, [0, 2, 3], "num_hidden_layers is 3 but model.safetensors holds 3 layers (0, 2, 3);"),
        (2, [1, 2], "num_hidden_layers is 2 but model.safetensors holds 2 layers (1-2);"),
        (10**18, [0, 10**8], "num_hidden_layers is 1000000000000000000 but model.safetensors holds 2 layers (0, 100000000);"),
    ],
)  # fmt: skip
def test_layer_problem_compares_the_layers_held_without_listing_a_huge_count(
    n_layers, layers, problem
):
    names = [f"model.layers.{i}.input_layernorm.weight" for i in layers] + ["model.norm.weight"]
    said = layer_problem(n_layers, names, "model.safetensors")
    assert said is None if problem is None else (said is not None and said.startswith(problem))


MOE = {"moe_num_experts": 3, "moe_top_k": 2, "moe_hidden_dim": 24}
SHAPED = [
    CFG,
    attrs.evolve(CFG, tie_embeddings=True, n_kv_heads=None),
    attrs.evolve(CFG, qk_norm=True, head_dim=16),  # Qwen3: a head wider than dim / n_heads
    attrs.evolve(CFG, **MOE),  # Mixtral
    attrs.evolve(CFG, qk_norm=True, moe_first_dense=1, **MOE),  # Qwen3-MoE, a dense block
]


@pytest.mark.parametrize("cfg", SHAPED, ids=["llama", "tied", "qwen3", "mixtral", "qwen3_moe"])
def test_hf_shapes_are_the_shapes_the_export_writes(cfg):
    with torch.device("meta"):
        state = Transformer(cfg).state_dict()
    written = {
        k: tuple(v.shape) for name, t in state.items() for k, v in hf_tensors(name, t, cfg).items()
    }
    assert hf_shapes(cfg, export_family(cfg)) == written


Q0 = "model.layers.0.self_attn.q_proj.weight"


def found_after(change) -> dict[str, tuple[int, ...]]:
    found = hf_shapes(CFG, families.LLAMA)
    change(found)
    return found


@pytest.mark.parametrize(
    ("change", "tied", "problem"),
    [
        (lambda f: None, False, None),
        (lambda f: f.pop("lm_head.weight"), True, None),  # tied: the head may be left out
        (lambda f: f.update({"model.layers.1.self_attn.rotary_emb.inv_freq": (4,)}), False, None),
        (lambda f: f.pop("lm_head.weight"), False, "missing 1 tensor config.json implies (lm_head.weight)"),
        (lambda f: [f.pop(k) for k in list(f)[:5]], False, "missing 5 tensors config.json implies (model.embed_tokens.weight, model.layers.0.input_layernorm.weight, model.layers.0.self_attn.q_proj.weight and 2 more)"),
        (lambda f: f.update({"model.layers.0.self_attn.q_proj.bias": (32,)}), False, "1 tensor a Llama model forge reads has no place for (model.layers.0.self_attn.q_proj.bias)"),
        (lambda f: f.update({Q0: (16, 32)}), False, f"1 tensor of another shape than config.json implies ({Q0}: shape [16, 32], config.json implies [32, 32])"),
        (lambda f: f.update({"model.norm.weight": ()}), False, "1 tensor of another shape than config.json implies (model.norm.weight: shape [], config.json implies [32])"),
    ],
)  # fmt: skip
def test_tensor_problems(change, tied, problem):
    said = tensor_problems(hf_shapes(CFG, families.LLAMA), found_after(change), tied)
    assert said == [] if problem is None else (len(said) == 1 and said[0].startswith(problem)), said


def test_dtype_and_finite_problems_name_the_tensors():
    good = torch.ones(3)
    assert dtype_problems({"a": good, "b": good.half(), "c": good.double()}) == []
    assert dtype_problems({"a": good, "b": good.int(), "c": good > 0}) == [
        "2 tensors not floating point (b: dtype int32, c: dtype bool); forge imports float "
        "weights (F32, BF16, F16)"
    ]
    assert finite_problems({"a": good}) == []
    bad = {"a": good, "b": torch.tensor([1.0, math.nan]), "c": torch.tensor([-math.inf])}
    (line,) = finite_problems(bad)
    assert line.startswith("2 tensors holding NaN or infinity (b, c);")


@pytest.mark.parametrize(
    ("data", "cause"),
    [
        (b"", "header too small"),
        (b"\x08\x00\x00\x00\x00\x00\x00\x00{not js}", "invalid JSON in header"),
        (b"\x00\x00\x00\x00\x00\x00\x00\x40" + b"{}", "header too large"),
    ],
)
def test_a_damaged_safetensors_file_is_one_line_naming_it(tmp_path, data, cause):
    (tmp_path / "model.safetensors").write_bytes(data)
    with pytest.raises(ExportError) as info:
        read_headers(find_weights(tmp_path))
    (line,) = info.value.lines
    assert (
        line.startswith(f"{tmp_path / 'model.safetensors'}: not a safetensors file")
        and cause in line
    )


def test_a_json_file_beyond_64_mib_is_refused_unread(tmp_path):
    path = tmp_path / "config.json"
    with path.open("wb") as f:
        f.truncate(64 * 2**20 + 1)  # sparse: nothing written
    with pytest.raises(ExportError) as info:
        read_json(path, "")
    assert info.value.lines == [
        f"{path}: 67108865 bytes, beyond the 64 MiB a JSON file of a model holds"
    ]
