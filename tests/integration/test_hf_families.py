"""Llama-3.x (llama3 RoPE scaling), Qwen3, Mixtral and Qwen3-MoE: tiny random models built by
transformers and saved with ``save_pretrained`` (nothing downloaded) import with transformers'
logits and greedy text, export back to a folder transformers loads with the same logits and
the same tensors, and every folder forge cannot compute exactly is refused in one line."""

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
from forge.config.sections import RopeScaling
from forge.interop.export import export_model
from forge.interop.export_rules import export_family
from forge.interop.families import LLAMA, MIXTRAL, QWEN3, QWEN3_MOE
from forge.interop.family import FamilySpec
from forge.interop.hf_import import import_model
from forge.model.generate import sample
from forge.model.transformer import Transformer
from tests.e2e.test_train_script import load_script

transformers = pytest.importorskip("transformers")  # in the dev extra: runs in `make test`

CONVERT = load_script("convert_checkpoint")
SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 64,
    "intermediate_size": 96,
}
# Llama 3.1's scaling at a context of 32: with a head of 16 and base 10^4 the rotary
# wavelengths (6.3, 20, 63, ...) fall in all three of its bands (kept, interpolated, slowed)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@attrs.frozen
class Case:
    """One family: its transformers config class and model class, the keys beside ``SHAPE``."""

    family: FamilySpec
    config: str
    model: str
    keys: dict[str, Any]


CASES = {
    "llama3": Case(
        LLAMA,
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True, "rms_norm_eps": 1e-5},
    ),
    "qwen3": Case(  # a head of 32: 4 heads are 128 wide, twice hidden_size
        QWEN3,
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"head_dim": 32, "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e6}},
    ),
    "mixtral": Case(
        MIXTRAL,
        "MixtralConfig",
        "MixtralForCausalLM",
        {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": Case(  # block 0 dense, block 1 sparse: moe_first_dense = 1
        QWEN3_MOE,
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 32,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
}


def hf_model(case: Case) -> Any:
    """The case's transformers model with random weights large enough that the logits differ
    by token (transformers' 0.02 init gives near-uniform logits and greedy ties)."""
    config = getattr(transformers, case.config)(**(SHAPE | case.keys))
    model = getattr(transformers, case.model)(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else 0.15 * noise)
    return model


def save(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Case, Any, pathlib.Path]:
    """(case, the transformers model, the folder its ``save_pretrained`` wrote)."""
    case = CASES[name]
    model = hf_model(case)
    folder = tmp_path_factory.mktemp(name) / "hf"
    model.save_pretrained(folder)
    return case, model, folder


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def saved(request, tmp_path_factory) -> tuple[Case, Any, pathlib.Path]:
    """Each family's saved model in turn."""
    return save(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> tuple[Case, Any, pathlib.Path]:
    """The Llama case alone (its RoPE is scaled)."""
    return save("llama3", tmp_path_factory)


def forge_model(folder: pathlib.Path) -> Transformer:
    cfg, state = import_model(folder)
    model = Transformer(cfg).eval()
    model.load_state_dict(state)
    return model


def logits(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out[0] if isinstance(out, tuple) else out  # a mixture of experts adds its stats


TOKENS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
PROMPT = [5, 10, 20, 30]


@torch.no_grad()
def test_an_import_has_transformers_logits_and_greedy_text(saved):
    case, hf, folder = saved
    model = forge_model(folder)
    assert export_family(model.cfg) is case.family  # it exports back as what it was
    theirs = hf(TOKENS).logits
    difference = (logits(model, TOKENS) - theirs).abs().max().item()
    print(f"{case.family.model_type}: max |forge - transformers| logit = {difference:.3g}")
    assert difference <= 1e-4
    ours = sample(model, PROMPT, 12, temperature=0)
    expected = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12)
    assert ours == expected[0].tolist()
    assert len(set(ours[len(PROMPT) :])) > 2  # not one token repeated: a real comparison


def safetensors_of(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@torch.no_grad()
def test_an_export_loads_in_transformers_with_the_same_logits_and_tensors(saved, tmp_path):
    case, hf, folder = saved
    model = forge_model(folder)
    export_model(model.state_dict(), model.cfg, tmp_path / "exp", "float32")
    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert config["architectures"] == [case.family.architecture]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exp").eval()
    assert type(back).__name__ == case.model
    torch.testing.assert_close(back(TOKENS).logits, hf(TOKENS).logits, atol=1e-6, rtol=0)
    written, original = safetensors_of(tmp_path / "exp"), safetensors_of(folder)
    assert written.keys() == original.keys()  # a tied head left out by both
    assert all(torch.equal(written[k], original[k]) for k in original)
    assert import_model(tmp_path / "exp")[0] == model.cfg  # and the config round-trips


@torch.no_grad()
def test_llama3_rope_tables_are_transformers_bit_for_bit_and_matter(llama3):
    _, hf, folder = llama3
    model = forge_model(folder)
    assert model.cfg.rope_scaling == RopeScaling(factor=8.0, original_max_seq_len=32)
    positions = torch.arange(64)[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, 64, 64), positions)
    half = model.cfg.head_size // 2
    assert torch.equal(model.rope_cos, cos[0, :, :half])
    assert torch.equal(model.rope_sin, sin[0, :, :half])
    plain = Transformer(attrs.evolve(model.cfg, rope_scaling=None)).eval()
    plain.load_state_dict(model.state_dict())
    assert (plain(TOKENS) - hf(TOKENS).logits).abs().max() > 1e-2  # the scaling is exercised


def test_a_transformers_v4_rope_scaling_imports_as_the_v5_spelling(llama3, tmp_path):
    """Llama 3.1's own config.json: ``rope_scaling`` (v4's key) beside a top-level
    ``rope_theta``, where v5's save writes ``rope_parameters``."""
    _, _, folder = llama3
    shutil.copytree(folder, tmp_path / "v4")
    path = tmp_path / "v4" / "config.json"
    doc = json.loads(path.read_text())
    scaling = {k: v for k, v in doc.pop("rope_parameters").items() if k != "rope_theta"}
    path.write_text(json.dumps(doc | {"rope_theta": 10000.0, "rope_scaling": scaling}))
    assert import_model(tmp_path / "v4")[0] == import_model(folder)[0]


# --- refusals: convert_checkpoint.py import on a copy of a valid folder with one thing
# changed: exit 2, one ``error:`` line naming the key, nothing written


def config_change(change: dict[str, Any]) -> Callable[[pathlib.Path], None]:
    """config.json with keys replaced (``...`` deletes one)."""

    def apply(folder: pathlib.Path) -> None:
        path = folder / "config.json"
        doc = json.loads(path.read_text())
        for key, value in change.items():
            doc.pop(key, None) if value is ... else doc.__setitem__(key, value)
        path.write_text(json.dumps(doc))

    return apply


def drop_tensors(fragment: str) -> Callable[[pathlib.Path], None]:
    def apply(folder: pathlib.Path) -> None:
        from safetensors.torch import save_file

        state = safetensors_of(folder)
        save_file(
            {k: v for k, v in state.items() if fragment not in k}, str(folder / "model.safetensors")
        )

    return apply


YARN = {
    "rope_type": "yarn",
    "rope_theta": 1e4,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}
# (case, family, change, a fragment of the one error line)
REFUSED = [
    ("yarn RoPE", "llama3", config_change({"rope_parameters": YARN}), "RoPE type 'yarn' (rope scaling) is not implemented by forge"),
    ("dynamic RoPE", "llama3", config_change({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}), "RoPE type 'dynamic'"),
    ("linear RoPE (v4's key)", "qwen3", config_change({"rope_scaling": {"type": "linear", "factor": 2.0}}), "RoPE type 'linear'"),
    ("llama3 RoPE without its factor", "llama3", config_change({"rope_parameters": LLAMA3_ROPE | {"factor": None}}), "rope_parameters.factor: missing; a 'llama3' RoPE states it"),
    ("llama3 RoPE with a factor below 1", "llama3", config_change({"rope_parameters": LLAMA3_ROPE | {"factor": 0.5}}), "gives model.rope_scaling.factor must be >= 1"),
    ("norm_topk_prob false", "qwen3_moe", config_change({"norm_topk_prob": False}), "norm_topk_prob false (transformers' default when absent): the top-k routing weights are not renormalised"),
    ("norm_topk_prob absent", "qwen3_moe", config_change({"norm_topk_prob": ...}), "norm_topk_prob false"),
    ("a sparse step forge has no layout for", "qwen3_moe", config_change({"mlp_only_layers": [1]}), "decoder_sparse_step 1 with mlp_only_layers [1]: forge places experts"),
    ("mlp_only_layers not indices", "qwen3_moe", config_change({"mlp_only_layers": [-1]}), "mlp_only_layers: expected a list of block indices"),
    ("Qwen3 with a sliding window", "qwen3", config_change({"use_sliding_window": True, "sliding_window": 16}), "use_sliding_window true: forge imports Qwen3 attending to the whole context"),
    ("Mixtral with a sliding window", "mixtral", config_change({"sliding_window": 16}), "sliding_window 16: forge imports Mixtral attending to the whole context"),
    ("Qwen3 attention biases", "qwen3", config_change({"attention_bias": True}), "attention or MLP biases"),
    ("an expert more than the weights", "mixtral", config_change({"num_local_experts": 5}), "config.json: 5 experts a block, but model.safetensors holds 4 experts (0, 1, 2, 3)"),
    ("Qwen3 without its query norms", "qwen3", drop_tensors("q_norm"), "missing 2 tensors config.json implies (model.layers.0.self_attn.q_norm.weight"),
    ("Qwen3-MoE's expert count as a string", "qwen3_moe", config_change({"num_local_experts": "4"}), "num_local_experts: expected an integer, got '4'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("family", "change", "fragment"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_what_forge_cannot_compute_exactly_is_refused_in_one_line(
    tmp_path, family, change, fragment
):
    folder = tmp_path / "hf"
    hf_model(CASES[family]).save_pretrained(folder)
    change(folder)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = CONVERT.main(["import", str(folder), "--out", str(tmp_path / "imported")])
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], err.getvalue()
    assert code == 2 and "Traceback" not in err.getvalue()
    assert not (tmp_path / "imported").exists()


def test_the_model_section_the_import_prints_loads_back(saved, tmp_path):
    """The [model] section the import prints loads back (``[model.rope_scaling]`` a table)."""
    import tomli

    from forge.config.loader import CONVERTER

    case, _, folder = saved
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert CONVERT.main(["import", str(folder), "--out", str(tmp_path / "imported")]) == 0
    section = tomli.loads(out.getvalue()[out.getvalue().index("\n[model]") :])["model"]
    cfg = CONVERTER.structure(section, ModelConfig)
    assert cfg == import_model(folder)[0]
    assert ("rope_scaling" in section) is (case.family is LLAMA)


def test_continued_pre_training_of_a_released_model_as_docs_interop_shows(tiny_config, tmp_path):
    """docs/interop.md's workflow on a tiny Qwen3 that transformers wrote: import, train from it
    with checkpoint.load_path and the [model] section the import printed, export, and
    transformers loads the export with the trained model's logits."""
    from tests.e2e.test_train_script import TRAIN, run_dir

    shape = SHAPE | {"vocab_size": 259, "max_position_embeddings": 32}
    config = transformers.Qwen3Config(**(shape | CASES["qwen3"].keys))
    hf = transformers.Qwen3ForCausalLM(config)
    hf.save_pretrained(tmp_path / "released")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = ["import", str(tmp_path / "released"), "--out", str(tmp_path / "imported")]
        assert CONVERT.main(argv) == 0
    model_section = out.getvalue()[out.getvalue().index("\n[model]") :]
    text = tiny_config.read_text()
    tiny_config.write_text(model_section + "\n" + text[text.index("[train]") :])
    load = f"--checkpoint.load_path={tmp_path / 'imported' / 'step_0'}"
    assert TRAIN.main([str(tiny_config), load, "--train.max_steps=3"]) == 0
    export = ["export", str(run_dir(tiny_config)), "--out", str(tmp_path / "exp")]
    with contextlib.redirect_stdout(io.StringIO()):
        assert CONVERT.main([*export, "--dtype", "float32"]) == 0
    trained = forge_model(tmp_path / "exp")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exp").eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    x = TOKENS[:, :32] % 259
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, logits(trained, x), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(back(x).logits, hf.eval()(x).logits, atol=1e-3)  # it trained


NATIVE = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=300, max_seq_len=64)
# models born in forge, in layouts no test folder above has
NATIVE_CASES = {
    "llama, llama3 RoPE, a head of 8": attrs.evolve(
        NATIVE, head_dim=8, rope_scaling=RopeScaling(factor=4.0, original_max_seq_len=16)
    ),
    "qwen3, untied": attrs.evolve(NATIVE, qk_norm=True, head_dim=24),
    "qwen3_moe, every 2nd block after 1 dense": attrs.evolve(
        NATIVE, qk_norm=True, moe_num_experts=4, moe_top_k=2, moe_every=2, moe_first_dense=1
    ),
}


@pytest.mark.parametrize("cfg", list(NATIVE_CASES.values()), ids=list(NATIVE_CASES))
@torch.no_grad()
def test_a_forge_model_exports_to_its_family_with_the_same_logits(cfg, tmp_path):
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    for p in model.parameters():
        p.mul_(5.0)  # larger than init: logits that differ by token
    export_model(model.state_dict(), cfg, tmp_path / "exp", "float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exp").eval()
    assert type(hf).__name__ == export_family(cfg).architecture
    torch.testing.assert_close(hf(TOKENS).logits, logits(model, TOKENS), atol=1e-4, rtol=1e-4)
    back, state = import_model(tmp_path / "exp")  # the same model, maybe in other keys
    assert back.moe_layers == cfg.moe_layers and back.rope_scaling == cfg.rope_scaling
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
