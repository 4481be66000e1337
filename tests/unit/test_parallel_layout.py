"""World info, mesh layout and parallel validation: pure functions, tables."""

import pytest

from forge.config import structure_config
from forge.config.sections import DistributedConfig
from forge.parallel.mesh import backend_problem, coordinates, usable_backend
from forge.parallel.world import (
    MeshDims,
    WorldInfo,
    first_host,
    local_gpu_problem,
    parallel_problems,
    resolve_dims,
    shared_store_problem,
    slurm_port,
    world_info,
)

# (case, environment, expected)
WORLDS = [
    ("no launcher", {}, WorldInfo()),
    (
        "torchrun",
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "MASTER_ADDR": "n1",
            "MASTER_PORT": "1234",
        },
        WorldInfo(3, 1, 4, "n1", 1234, "torchrun"),
    ),
    (
        "slurm",
        {
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "8",
            "SLURM_JOB_NODELIST": "gpu[003-004]",
            "SLURM_JOB_ID": "123456",
        },
        WorldInfo(5, 1, 8, "gpu003", 20000 + 123456 % 20000, "slurm"),
    ),
    (
        "slurm with explicit master",
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "head", "MASTER_PORT": "777"},
        WorldInfo(0, 0, 2, "head", 777, "slurm"),
    ),
    (
        "torchrun inside slurm wins",
        {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
        WorldInfo(1, 0, 2, "127.0.0.1", 29500, "torchrun"),
    ),
]


@pytest.mark.parametrize("env,expected", [w[1:] for w in WORLDS], ids=[w[0] for w in WORLDS])
def test_world_info(env, expected):
    assert world_info(env) == expected


@pytest.mark.parametrize(
    "nodelist,host",
    [
        ("node1", "node1"),
        ("gpu[003-005,7]", "gpu003"),
        ("gpu[12,14]", "gpu12"),
        ("a1,b2", "a1"),
        ("x[1]", "x1"),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_slurm_port_is_stable_and_in_range():
    assert slurm_port("42") == slurm_port("42") == 20042
    assert all(20000 <= slurm_port(str(j)) < 40000 for j in (0, 19999, 20000, 987654321))


AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2",
         "TORCHELASTIC_MAX_RESTARTS": "3"}  # fmt: skip
# (case, torchrun's worker environment, refused)
SHARED_STORES = [
    ("no torchrun", {}, False),
    ("several nodes, restarts, one shared store", AGENT, True),
    ("one node: a prefix per round keeps the rounds apart", AGENT | {"GROUP_WORLD_SIZE": "1"}, False),
    ("no restarts", AGENT | {"TORCHELASTIC_MAX_RESTARTS": "0"}, False),
    ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on the agents", AGENT | {"TORCHELASTIC_USE_AGENT_STORE": "False"}, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("env", "refused"), [c[1:] for c in SHARED_STORES], ids=[c[0] for c in SHARED_STORES]
)
def test_a_multi_node_torchrun_that_could_not_restart_is_refused_naming_the_variable(env, refused):
    problem = shared_store_problem(env)
    assert (problem is not None) is refused
    if refused:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in problem and "--max-restarts=3" in problem


@pytest.mark.parametrize(
    ("local_rank", "gpus", "refused"),
    [(0, 0, False), (3, 0, False), (0, 1, False), (7, 8, False), (1, 1, True), (8, 8, True)],
)
def test_a_rank_past_the_gpus_it_sees_is_refused(local_rank, gpus, refused):
    problem = local_gpu_problem(local_rank, gpus)
    assert (problem is not None) is refused
    if refused:
        assert f"local rank {local_rank}" in problem and "--gpus-per-node" in problem


# (case, config, world size, dims, mesh)
DIMS = [
    ("one process", DistributedConfig(), 1, MeshDims(), ()),
    ("dp_shard = rest", DistributedConfig(), 4, MeshDims(dp_shard=4), (("dp_shard", 4),)),
    (
        "tp takes a share",
        DistributedConfig(tp=2),
        4,
        MeshDims(dp_shard=2, tp=2),
        (("dp_shard", 2), ("tp", 2)),
    ),
    (
        "hsdp",
        DistributedConfig(dp_replicate=2, dp_shard=2),
        4,
        MeshDims(dp_replicate=2, dp_shard=2),
        (("dp_replicate", 2), ("dp_shard", 2)),
    ),
    (  # FSDP2 replicates over the first dim of a 2-D mesh only: a 1-D one would shard
        "replicas alone keep a dp_shard of 1",
        DistributedConfig(dp_replicate=2, dp_shard=1),
        2,
        MeshDims(dp_replicate=2),
        (("dp_replicate", 2), ("dp_shard", 1)),
    ),
    (
        "replicas x tp keep a dp_shard of 1",
        DistributedConfig(dp_replicate=2, dp_shard=1, tp=2),
        4,
        MeshDims(dp_replicate=2, tp=2),
        (("dp_replicate", 2), ("dp_shard", 1), ("tp", 2)),
    ),
    (  # cp is the dim FSDP2 shards over
        "replicas x cp need no dp_shard",
        DistributedConfig(dp_replicate=2, dp_shard=1, cp=2),
        4,
        MeshDims(dp_replicate=2, cp=2),
        (("dp_replicate", 2), ("cp", 2)),
    ),
    (
        "pp outermost",
        DistributedConfig(pp=2, tp=2),
        8,
        MeshDims(pp=2, dp_shard=2, tp=2),
        (("pp", 2), ("dp_shard", 2), ("tp", 2)),
    ),
]


@pytest.mark.parametrize("cfg,world,dims,named", [d[1:] for d in DIMS], ids=[d[0] for d in DIMS])
def test_resolve_dims_and_named_mesh(cfg, world, dims, named):
    assert resolve_dims(cfg, world) == dims
    assert dims.named() == named


@pytest.mark.parametrize(
    "rank,dims,coords",
    [
        (0, MeshDims(dp_shard=2), {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}),
        (1, MeshDims(dp_shard=2), {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0}),
        (1, MeshDims(tp=2), {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}),
        (
            5,
            MeshDims(pp=2, dp_shard=2, tp=2),
            {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1},
        ),
        (
            3,
            MeshDims(dp_replicate=2, dp_shard=2),
            {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "cp": 0, "tp": 0},
        ),
        (  # cp inside dp_shard: consecutive ranks split one row's tokens
            1,
            MeshDims(dp_shard=2, cp=2),
            {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 1, "tp": 0},
        ),
        (
            2,
            MeshDims(dp_shard=2, cp=2),
            {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0},
        ),
    ],
)
def test_coordinates_are_row_major(rank, dims, coords):
    assert coordinates(rank, dims) == coords


@pytest.mark.parametrize(
    "spec,cuda,backend",
    [
        ("cpu:gloo,cuda:nccl", False, "gloo"),
        ("cpu:gloo,cuda:nccl", True, "cpu:gloo,cuda:nccl"),
        ("gloo", False, "gloo"),
    ],
)
def test_usable_backend(spec, cuda, backend):
    assert usable_backend(spec, cuda) == backend


# (case, distributed.backend, a GPU here, what the refusal says: None starts)
BACKENDS = [
    ("the default on a CPU", "cpu:gloo,cuda:nccl", False, None),
    ("gloo", "gloo", False, None),
    ("NCCL without a GPU", "nccl", False, "NCCL needs CUDA devices and this machine has none"),
    ("a backend this torch lacks", "mpi", False, "this torch has no 'mpi' backend"),
    ("a backend no torch has", "cpu:xyz", False, "this torch has no 'xyz' backend"),
    ("NCCL in capitals", "NCCL", False, "NCCL needs CUDA devices"),
    (
        "a GPU's entry alone on a CPU",
        "cuda:nccl",
        False,
        "it names no backend for this machine's devices (cpu)",
    ),
]


@pytest.mark.parametrize("spec,cuda,why", [b[1:] for b in BACKENDS], ids=[b[0] for b in BACKENDS])
def test_a_backend_that_cannot_start_here_is_refused_by_name(spec, cuda, why):
    problem = backend_problem(spec, cuda)
    if why is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(f"distributed.backend: {spec!r}: {why}")


BASE = {
    "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
    "train": {"seq_len": 32, "grad_accum_steps": 2},
}


def cfg(**sections):
    raw = {k: dict(v) for k, v in BASE.items()}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return structure_config(raw)


# (case, config, world size, expected lines)
RULES = [
    ("fits", cfg(distributed={"dp_shard": 2}), 2, []),
    (
        "product differs from the world",
        cfg(distributed={"dp_shard": 2, "tp": 2}),
        2,
        [
            "distributed: pp*dp_replicate*dp_shard*tp = 1*1*2*2 = 4, but the world size is 2; make them equal"
        ],
    ),
    (
        "tp must divide heads",
        cfg(
            distributed={"tp": 3},
            model={"dim": 96, "n_heads": 6, "n_kv_heads": 2},
            train={"seq_len": 32},
        ),
        3,
        [
            "distributed.tp: must divide model.n_kv_heads=2",
            "distributed.tp: must divide train.seq_len=32 (sequence parallelism)",
        ],
    ),
    (
        "tp must divide query heads",
        cfg(distributed={"tp": 4}, model={"dim": 96, "n_heads": 6, "n_kv_heads": 6}),
        4,
        [
            "distributed.tp: must divide model.n_heads=6",
            "distributed.tp: must divide model.n_kv_heads=6",
        ],
    ),
    (
        "pp needs layers",
        cfg(distributed={"pp": 4}, model={"n_layers": 2}, train={"grad_accum_steps": 4}),
        4,
        ["distributed.pp: needs model.n_layers >= 4 stages, got 2"],
    ),
    (
        "pp needs micro-batches",
        cfg(distributed={"pp": 2}, train={"grad_accum_steps": 1}),
        2,
        [
            "train.grad_accum_steps: must be >= 2 (the pipeline's micro-batches per step) with distributed.pp=2 and pp_schedule='1f1b'"
        ],
    ),
    (
        "interleaved runs",
        cfg(distributed={"pp": 2, "pp_schedule": "interleaved_1f1b"}),
        2,
        [],
    ),
    (
        "tied embeddings under FSDP2",
        cfg(distributed={"dp_shard": 2}, model={"tie_embeddings": True}),
        2,
        [],
    ),
    (
        "tied embeddings under TP",
        cfg(distributed={"dp_shard": 1, "tp": 2}, model={"tie_embeddings": True}),
        2,
        [],
    ),
    (
        "tied embeddings across pipeline stages",
        cfg(distributed={"dp_shard": 1, "pp": 2}, model={"tie_embeddings": True}),
        2,
        [],
    ),
    ("tied embeddings alone", cfg(model={"tie_embeddings": True}), 1, []),
    (
        "pp eval needs whole groups",
        cfg(distributed={"pp": 2}, eval={"interval": 5, "steps": 1}),
        2,
        [
            "eval.steps: must be >= train.grad_accum_steps=2 under distributed.pp > 1 (eval batches go through the pipeline in groups)"
        ],
    ),
]


@pytest.mark.parametrize("config,world,lines", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_parallel_validation(config, world, lines):
    assert [f"{k}: {m}" for k, m in parallel_problems(config, world)] == lines


def test_distributed_section_ranges():
    from forge.config import ConfigError

    with pytest.raises(ConfigError) as info:
        structure_config({"distributed": {"dp_shard": 0, "tp": 0}})
    assert info.value.lines == [
        "distributed.tp: must be > 0, got 0",
        "distributed.dp_shard: must be -1 (the rest) or >= 1, got 0",
    ]


# (mixed_precision, param_dtype, FSDP2 param dtype, FSDP2 reduce dtype)
FSDP_POLICIES = [
    ("fp32", "fp32", None, "float32"),
    ("bf16", "fp32", "bfloat16", "float32"),  # gathered weights cast to bf16, fp32 reduction
    ("bf16", "bf16", None, "bfloat16"),  # pure bf16: nothing to cast, bf16 reduction
]


@pytest.mark.parametrize("compute,params,param_dtype,reduce_dtype", FSDP_POLICIES)
def test_fsdp_policy_follows_the_two_precision_keys(compute, params, param_dtype, reduce_dtype):
    import torch

    from forge.config.sections import Precision
    from forge.parallel.parallelize import fsdp_policy

    policy = fsdp_policy(Precision(compute), Precision(params))
    assert policy.param_dtype == (getattr(torch, param_dtype) if param_dtype else None)
    assert policy.reduce_dtype == getattr(torch, reduce_dtype)


@pytest.mark.parametrize("world_size,refused", [(1, False), (2, True)])
def test_a_backend_that_cannot_start_is_named_with_the_config_s_other_problems(
    tiny_config, monkeypatch, world_size, refused
):
    """Checked with the config (``WORLD_CHECKS``), in the same pass as every other problem,
    before any process group starts; one process starts none, so names nothing."""
    from forge.config.loader import ConfigError
    from forge.training.setup.phases import load_and_validate_config

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = [str(tiny_config), "--distributed.backend=nccl", "--hooks.bogus=1"]
    with pytest.raises(ConfigError) as caught:
        load_and_validate_config(args)
    backend = [x for x in caught.value.lines if x.startswith("distributed.backend: 'nccl'")]
    assert len(backend) == int(refused), caught.value.lines
    assert any(x.startswith("hooks") for x in caught.value.lines), caught.value.lines
