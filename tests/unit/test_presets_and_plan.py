"""The shipped presets have their model cards' sizes; the memory plan adds up as documented."""

from __future__ import annotations

import subprocess

import attrs
import pytest
import torch

from forge.config import load_config
from forge.config.latent import LatentConfig
from forge.config.sections import ActivationCheckpointing, Float8Recipe, OptimizerName, Precision
from forge.metrics.flops import non_embedding_parameters
from forge.model.transformer import Transformer, num_parameters
from forge.parallel.memory_plan import GIB, memory_plan, stage_parameters
from forge.parallel.world import MeshDims
from tests.conftest import REPO
from tests.e2e.test_train_script import load_script
from tests.in_process import run_main

# (preset, the published parameter count, embeddings tied)
PRESETS = [
    ("llama3_1b", 1.23e9, True),  # Llama 3.2 1B
    ("llama3_3b", 3.21e9, True),  # Llama 3.2 3B
    ("llama3_8b", 8.03e9, False),  # Llama 3.1 8B
    ("llama3_70b", 70.6e9, False),  # Llama 3.1 70B
]


def preset(name: str):
    return load_config([str(REPO / "configs" / "train" / f"{name}.toml")]).config


@pytest.mark.parametrize(("name", "published", "tied"), PRESETS, ids=[p[0] for p in PRESETS])
def test_each_preset_builds_with_its_model_cards_parameter_count(name, published, tied):
    cfg = preset(name)
    with torch.device("meta"):  # nothing allocated, even for 70B
        model = Transformer(cfg.model)
    count = num_parameters(model)
    assert count == pytest.approx(published, rel=0.005)
    assert cfg.model.tie_embeddings is tied
    assert cfg.model.kv_heads < cfg.model.n_heads  # grouped-query attention
    embedding = 0 if tied else cfg.model.vocab_size * cfg.model.dim
    assert count == non_embedding_parameters(cfg.model) + embedding


# (preset, the exact count of the released model's config.json, its RoPE scaling factor)
RELEASED = [
    ("llama3_1b", 1_235_814_400, 32.0),  # Llama-3.2-1B
    ("llama3_3b", 3_212_749_824, 32.0),  # Llama-3.2-3B
    ("qwen3_0_6b", 596_049_920, None),  # Qwen3-0.6B: head_dim 128 beside dim 1024 / 16 heads
]


@pytest.mark.parametrize(("name", "count", "factor"), RELEASED, ids=[r[0] for r in RELEASED])
def test_presets_of_released_models_have_their_exact_count_and_rope(name, count, factor):
    cfg = preset(name).model
    with torch.device("meta"):
        model = Transformer(cfg)
    assert num_parameters(model) == count == non_embedding_parameters(cfg)  # tied
    assert (cfg.rope_scaling.factor if cfg.rope_scaling else None) == factor


@pytest.mark.parametrize("name", [r[0] for r in RELEASED])
def test_the_presets_export_config_builds_transformers_model_of_the_same_count(name):
    """transformers' own class, from the config.json forge's export writes for the preset,
    on the meta device: the same parameters (so the preset is the released shape)."""
    transformers = pytest.importorskip("transformers")
    from forge.interop.export import hf_config

    config = hf_config(preset(name).model, "bfloat16")
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    hf = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert type(model).__name__ == config["architectures"][0]
    assert sum(p.numel() for p in model.parameters()) == dict((r[0], r[1]) for r in RELEASED)[name]


# (preset, total parameters, active per token, tolerance): Mixtral's published counts exactly;
# the DeepSeekMoE-16B model card's 16.4B / 2.8B to its rounding; the debug model's by hand
# (blocks: attention 196,608 + 8 routed and 1 shared experts of 3·256·232 + router 2,048 +
# norms 512; 4 blocks, final norm, embedding and head 2·259·256; active: 2 routed + 1 shared)
MOE_PRESETS = [
    ("mixtral_8x7b", 46_702_792_704, 12_879_925_248, 0),
    ("deepseek_moe_16b", 16.4e9, 2.8e9, 0.05e9),
    ("debug_moe", 7_343_872, 3_067_648, 0),
]


@pytest.mark.parametrize(
    ("name", "total", "active", "tolerance"), MOE_PRESETS, ids=[p[0] for p in MOE_PRESETS]
)
def test_each_moe_preset_has_its_total_and_active_parameter_counts(name, total, active, tolerance):
    cfg = preset(name).model
    with torch.device("meta"):
        model = Transformer(cfg)
    embedding = cfg.vocab_size * cfg.dim
    assert num_parameters(model) == pytest.approx(total, abs=tolerance)
    assert non_embedding_parameters(cfg, active=True) + embedding == pytest.approx(
        active, abs=tolerance
    )
    assert num_parameters(model) == non_embedding_parameters(cfg) + embedding


def test_the_debug_moe_model_is_as_wide_per_token_as_the_dense_debug_model():
    dense, moe = preset("debug").model, preset("debug_moe").model
    active, dense_count = (
        non_embedding_parameters(moe, active=True),
        non_embedding_parameters(dense),
    )
    assert active == pytest.approx(dense_count, rel=0.01)
    assert moe.moe_num_experts == 8 and moe.moe_top_k == 2 and moe.moe_shared_experts == 1


EIGHT_B = preset("llama3_8b")
P_8B = 8_030_261_248


def test_the_8b_plan_on_8_ranks_worked_by_hand():
    """FSDP over 8: fp32 weights and gradients, AdamW's two fp32 moments, all / 8."""
    plan = memory_plan(EIGHT_B, MeshDims(dp_shard=8))
    assert plan.parameters == plan.gradients == round(P_8B * 4 / 8)
    assert plan.optimizer_state == round(2 * P_8B * 4 / 8)
    # full AC: each of 32 blocks keeps its bf16 input (8192 tokens x 4096), plus one block's
    # activations: 8192 x (10·4096 + 4·1024 + 4·14336) elements in bf16
    block_input = 8192 * 4096 * 2
    one_block = 8192 * (10 * 4096 + 4 * 1024 + 4 * 14336) * 2
    assert plan.activations == 32 * block_input + one_block
    assert plan.activations_without_ac == 32 * one_block
    assert plan.fits(80 * GIB) and not plan.fits(16 * GIB)


def evolve_train(cfg, **kwargs):
    return attrs.evolve(cfg, train=attrs.evolve(cfg.train, **kwargs))


@pytest.mark.parametrize(
    "recipe,check,fp8_gathered",
    [
        (Float8Recipe.TENSORWISE, 0, True),  # FSDP2 gathers the FP8 weights in FP8
        (Float8Recipe.TENSORWISE, 10, False),  # the drift guard gathers high precision
        (Float8Recipe.ROWWISE, 0, False),
    ],
)
def test_the_8b_plan_with_fp8_worked_by_hand(recipe, check, fp8_gathered):
    """The FP8 casts: the largest FP8 layer is the feed-forward's (14336 x 4096): in backward
    its output gradient, input and weight cast again, a byte an element. A gathered block's
    seven FP8 matrices at a byte where FSDP2 gathers them in FP8 (its two norms in bf16)."""
    off = memory_plan(EIGHT_B, MeshDims(dp_shard=8))
    plan = memory_plan(
        evolve_train(EIGHT_B, float8=recipe, float8_check=check), MeshDims(dp_shard=8)
    )
    assert off.float8_casts == 0
    assert plan.float8_casts == 8192 * (14336 + 4096) + 14336 * 4096
    matrices = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096  # wq wo, wk wv, w1 w2 w3
    saved = 2 * matrices * (2 - 1) if fp8_gathered else 0  # two blocks in flight, bf16 → byte
    assert off.gathered_weights - plan.gathered_weights == saved
    assert plan.activations == off.activations  # torchao keeps the high-precision tensors


# (change, part, expected ratio to the 8-rank FSDP plan's)
SCALING = [
    (dict(dims=MeshDims(dp_shard=4, tp=2)), "parameters", 1.0),  # same 8-way split
    (dict(dims=MeshDims(dp_shard=8, tp=2)), "parameters", 0.5),
    (dict(dims=MeshDims(dp_shard=8, tp=2)), "activations_without_ac", 0.5),  # sequence-parallel
    (dict(dims=MeshDims(dp_replicate=2, dp_shard=4)), "optimizer_state", 2.0),  # replicas hold it
    (dict(dims=MeshDims(dp_replicate=8)), "optimizer_state", 8.0),  # replicas alone: all of it
    (dict(dims=MeshDims(dp_replicate=8)), "gathered_weights", 1.0),  # whole shards copied out
    (dict(train=dict(param_dtype=Precision.BF16)), "optimizer_state", 0.5),  # pure bf16
    (dict(optimizer=OptimizerName.LION), "optimizer_state", 0.5),  # one moment
    (dict(train=dict(batch_size=2)), "activations", 2.0),
]


@pytest.mark.parametrize(("change", "part", "ratio"), SCALING)
def test_plan_parts_scale_with_the_layout_and_settings(change, part, ratio):
    base = memory_plan(EIGHT_B, MeshDims(dp_shard=8))
    cfg = EIGHT_B
    if "train" in change:
        cfg = evolve_train(cfg, **change["train"])
    if "optimizer" in change:
        cfg = attrs.evolve(cfg, optimizer=attrs.evolve(cfg.optimizer, name=change["optimizer"]))
    plan = memory_plan(cfg, change.get("dims", MeshDims(dp_shard=8)))
    assert getattr(plan, part) / getattr(base, part) == pytest.approx(ratio, rel=1e-3)


def test_activation_checkpointing_keeps_less():
    plans = {
        ac: memory_plan(evolve_train(EIGHT_B, activation_checkpointing=ac), MeshDims(dp_shard=8))
        for ac in ActivationCheckpointing
    }
    full, selective, none = (
        plans[ActivationCheckpointing(a)].activations for a in ("full", "selective", "none")
    )
    assert full < selective < none == plans[ActivationCheckpointing.NONE].activations_without_ac


def test_a_pipeline_stage_holds_its_share_of_layers_and_micro_batches_in_flight():
    cfg = attrs.evolve(EIGHT_B, distributed=attrs.evolve(EIGHT_B.distributed, pp=4))
    one, four = memory_plan(EIGHT_B, MeshDims()), memory_plan(cfg, MeshDims(pp=4))
    assert four.parameters < one.parameters / 3  # 8 of 32 blocks, plus an end
    # 1F1B keeps up to pp = 4 micro-batches (grad_accum_steps = 8) of 8 checkpointed blocks
    block_input = 8192 * 4096 * 2
    one_block = 8192 * (10 * 4096 + 4 * 1024 + 4 * 14336) * 2
    assert one.activations == 32 * block_input + one_block
    assert four.activations == 4 * (8 * block_input + one_block)


PLAN_SCRIPT = load_script("plan")


def plan(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``scripts/plan.py args`` (in this process: a report proves nothing more in its own)."""
    done = run_main(PLAN_SCRIPT.main, args)
    assert not check or done.returncode == 0, done.stderr
    return done


def test_plan_script_reports_the_parts_and_the_verdict():
    out = plan(
        str(REPO / "configs/train/llama3_70b.toml"), "--nproc", "8", "--gpu-memory-gb", "80"
    ).stdout
    assert "parameters: 70,553,706,496 total" in out
    assert "does NOT fit in 80 GiB per device" in out  # 70B on 8 GPUs with fp32 Adam: no
    out = plan(str(REPO / "configs/train/llama3_70b.toml"), "--nproc", "64").stdout
    assert "layout at 64 ranks: dp_replicate=1 dp_shard=8 tp=8 pp=1 cp=1" in out
    assert "\nfits in 80 GiB" in out
    assert "bubble" not in out  # no pipeline


def test_plan_script_prints_each_schedules_bubble_under_a_pipeline():
    args = ["--nproc", "32", "--distributed.pp=2", "--train.grad_accum_steps=8"]
    out = plan(str(REPO / "configs/train/llama3_70b.toml"), *args).stdout
    assert "pipeline: 2 stages (1 per rank), 8 micro-batches per step" in out
    lines = out.split("pipeline: ")[1].splitlines()[1:7]
    assert lines[0].split()[:2] == ["1f1b", "11.1%"]  # (p - 1) / (m + p - 1), chosen first
    assert lines[0].endswith("<- distributed.pp_schedule")
    shares = {line.split()[0]: line.split()[1] for line in lines}
    assert shares == {
        "1f1b": "11.1%",
        "gpipe": "11.1%",
        "interleaved_1f1b": "11.1%",  # one stage per rank: no gain
        "interleaved_zero_bubble": "4.0%",
        "zbv": "0.0%",
        "dualpipev": "0.0%",
    }


def test_plan_script_marks_the_schedules_fsdp2_refuses():
    args = ["--nproc", "64", "--distributed.pp=2", "--distributed.cp=2"]
    out = plan(
        str(REPO / "configs/train/llama3_70b.toml"), *args, "--train.grad_accum_steps=8"
    ).stdout
    lines = out.split("pipeline: ")[1].splitlines()[1:7]
    refused = {line.split()[0] for line in lines if "(refused under FSDP2" in line}
    assert refused == {"interleaved_zero_bubble", "zbv", "dualpipev"}  # backward in two halves


def test_plan_script_refuses_an_impossible_layout_in_one_line():
    done = plan(
        str(REPO / "configs/train/llama3_8b.toml"),
        "--nproc",
        "6",
        "--distributed.tp=4",
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: distributed: pp*dp_replicate*dp_shard*tp")


GPU_MEMORY = "--gpu-memory-gb: must be a finite number in (0, 1048576] (GiB per device), got"
NPROC = "--nproc: must be in [1, 2147483647] (ranks in the job), got"

# (case, plan.py's options, its error lines)
PLAN_OPTIONS = [
    ("memory nan", ["--gpu-memory-gb", "nan"], [f"{GPU_MEMORY} nan"]),
    ("memory inf", ["--gpu-memory-gb", "inf"], [f"{GPU_MEMORY} inf"]),
    ("memory -inf", ["--gpu-memory-gb=-inf"], [f"{GPU_MEMORY} -inf"]),
    ("memory negative", ["--gpu-memory-gb=-80"], [f"{GPU_MEMORY} -80.0"]),
    ("memory zero", ["--gpu-memory-gb", "0"], [f"{GPU_MEMORY} 0.0"]),
    ("memory beyond 1 PiB", ["--gpu-memory-gb", "1e308"], [f"{GPU_MEMORY} 1e+308"]),
    ("no ranks", ["--nproc", "0"], [f"{NPROC} 0"]),
    ("negative ranks", ["--nproc=-8"], [f"{NPROC} -8"]),
    ("ranks beyond 32 bits", ["--nproc", "99999999999999999999999"], [f"{NPROC} 99999999999999999999999"]),
    ("both at once", ["--nproc", "0", "--gpu-memory-gb", "nan"], [f"{NPROC} 0", f"{GPU_MEMORY} nan"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "options,errors", [c[1:] for c in PLAN_OPTIONS], ids=[c[0] for c in PLAN_OPTIONS]
)
def test_plan_script_refuses_each_out_of_range_option_in_one_line(
    tmp_path, monkeypatch, options, errors
):
    config = str(REPO / "configs/train/llama3_8b.toml")
    monkeypatch.chdir(tmp_path)
    done = plan(config, *options, check=False)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: {e}" for e in errors]
    assert done.stdout == "" and list(tmp_path.iterdir()) == []  # no plan, nothing written


def test_the_plan_counts_qwen3s_own_head_size():
    """Qwen3-0.6B's heads are 128 wide (dim / n_heads is 64): its RoPE tables (cos and sin,
    40960 positions x 64 fp32) and its key/value activations are counted at that width."""
    cfg = preset("qwen3_0_6b")
    plan = memory_plan(cfg, MeshDims(dp_shard=8))
    assert plan.buffers == 2 * 40960 * 64 * 4
    narrow = attrs.evolve(cfg, model=attrs.evolve(cfg.model, head_dim=64))
    kv_width = 8 * (128 - 64)  # kv heads x the extra channels
    tokens = cfg.train.batch_size * cfg.train.seq_len
    extra = tokens * 4 * kv_width * 2  # 4·kv_dim elements per token in bf16, one block's
    assert plan.activations - memory_plan(narrow, MeshDims(dp_shard=8)).activations == extra


DEBUG = preset("debug")  # dim 256, 4 blocks of 4 heads of 64, 2 KV heads; 4 x 256 tokens, fp32
MLA = dict(kv_rank=128, nope_dim=48, rope_dim=16, v_dim=64)
MOE = dict(moe_num_experts=8, moe_top_k=2, moe_shared_experts=1, moe_hidden_dim=232)
# Per token, by hand: 7·dim = 1792 around attention and feed-forward in every block.
# GQA: 3·256 + 4·128 = 1280; dense SwiGLU: 4·704 = 2816; one dense GQA block 5888.
# MLA (4 heads): queries 2·4·64 = 512, latent and rotated key 2·(128 + 16) = 288, wkv_b's
# expansion 4·(48 + 64) = 448, keys 4·64 = 256, output 4·64 = 256: 1760 (+ 2·96 for q_rank 96).
# MoE: router 2·8 = 16, two routed copies 2·(2·256 + 4·232) = 2880, one shared 4·232 = 928: 3824.
GQA_DENSE, MLA_DENSE, MLA_Q96, GQA_MOE = 5888, 6368, 6560, 6896
# (id, model keys, activation elements per token of all the blocks, the depths' included)
PER_TOKEN = [
    ("gqa", {}, 4 * GQA_DENSE),  # the formula before latent attention and MoE: unchanged
    ("mla", {"mla": MLA | {"q_rank": 0}}, 4 * MLA_DENSE),
    ("mla-q_rank", {"mla": MLA | {"q_rank": 96}}, 4 * MLA_Q96),
    ("moe", MOE, 4 * GQA_MOE),
    ("moe-first-dense", MOE | {"moe_first_dense": 1}, GQA_DENSE + 3 * GQA_MOE),
    ("moe-dense-depth", MOE | {"mtp_depth": 1}, 4 * GQA_MOE + GQA_DENSE),
    ("moe-moe-depths", MOE | {"mtp_depth": 2, "mtp_moe": True}, 6 * GQA_MOE),
    ("mla-moe-moe-depth", {"mla": MLA | {"q_rank": 96}} | MOE | {"mtp_depth": 1, "mtp_moe": True},
     5 * (1792 + 1952 + 3824)),
]  # fmt: skip


def debug_with(**model):
    if "mla" in model:
        model["mla"] = LatentConfig(**model["mla"])
    cfg = attrs.evolve(DEBUG, model=attrs.evolve(DEBUG.model, ffn_hidden_dim=704, **model))
    return evolve_train(cfg, activation_checkpointing=ActivationCheckpointing.NONE)


@pytest.mark.parametrize(
    ("model", "elements"), [c[1:] for c in PER_TOKEN], ids=[c[0] for c in PER_TOKEN]
)
def test_the_plan_counts_each_blocks_own_activations(model, elements):
    """Latent attention's tensors are its heads' widths, not GQA's; a mixture of experts keeps
    its router's scores and each routed copy's SwiGLU; a depth's block is a mixture of experts
    where ``mtp_moe``. Within 10% of what autograd saves for one block (fp32, eager, measured
    with saved-tensor hooks: GQA 5382, MLA 6231 and 6520, MoE 6920 a token)."""
    plan = memory_plan(debug_with(**model), MeshDims())
    tokens = 4 * 256
    assert plan.activations == plan.activations_without_ac == tokens * elements * 4


def test_full_checkpointing_recomputes_the_largest_block():
    """Each block (and depth) keeps its input; the one recomputed at a time is the largest."""
    cfg = debug_with(**MOE, moe_first_dense=3, mtp_depth=1)  # 3 dense blocks, 1 MoE, 1 dense depth
    cfg = evolve_train(cfg, activation_checkpointing=ActivationCheckpointing.FULL)
    assert memory_plan(cfg, MeshDims()).activations == 4 * 256 * (5 * 256 + GQA_MOE) * 4


def test_latent_attentions_compressions_are_whole_on_every_tensor_parallel_rank():
    """Under tp the heads are split; the latent with its rotated key (2·144) and the query
    bottleneck (2·96) are computed whole on every rank."""
    cfg = debug_with(mla=MLA | {"q_rank": 96})
    whole = 2 * 144 + 2 * 96
    per_rank = (MLA_Q96 - whole) // 2 + whole
    assert memory_plan(cfg, MeshDims(tp=2)).activations == 4 * 4 * 256 * per_rank * 4


def test_a_pipelines_depth_stage_counts_its_copy_of_the_embedding():
    """Under pp the depths sit on the last stage with the head and a copy of the embedding."""
    cfg = attrs.evolve(EIGHT_B, model=attrs.evolve(EIGHT_B.model, mtp_depth=1))
    cfg = attrs.evolve(cfg, distributed=attrs.evolve(cfg.distributed, pp=4))
    without = attrs.evolve(cfg, model=attrs.evolve(cfg.model, mtp_depth=0))
    depth = stage_parameters(cfg, 1)[0] - stage_parameters(without, 1)[0]
    embedding = 128256 * 4096
    assert stage_parameters(cfg, 4)[0] - stage_parameters(without, 4)[0] == depth + embedding


@pytest.mark.parametrize("args", [[], ["--nproc", "2"]], ids=["nothing", "its options only"])
def test_plan_script_without_a_config_names_its_own_usage(args):
    """The config loader's words named train.py's usage."""
    done = run_main(PLAN_SCRIPT.main, args)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: missing config file: usage: plan.py CONFIG.toml [--nproc N] "
        "[--section.key=value ...] (--help lists plan.py's own options)"
    ]
