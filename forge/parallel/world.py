"""Who this process is: world info from torchrun or SLURM variables, and the mesh layout.

Everything here is pure (it reads a mapping, not ``os.environ``), so every rule has a table test.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import attrs

from forge.config.sections import DistributedConfig, JobConfig, Problem
from forge.parallel.feature_layouts import sharded_only_problems
from forge.parallel.stages import (
    SPLIT_BACKWARD,
    boundary_problems,
    schedule_problems,
    splits_backward,
)


@attrs.frozen
class WorldInfo:
    """This process's place in the job, and where rank 0 listens."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "none"  # "torchrun", "slurm" or "none"
    # under torchrun's shared store: the key prefix of this restart round (see restart_namespace)
    store_prefix: str | None = None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[003-005,7],cpu1`` -> ``gpu003``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot parse a host name")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def slurm_port(job_id: str) -> int:
    """A port in [20000, 40000) derived from the job id, the same on every node of the job."""
    return 20000 + int(job_id) % 20000


def restart_namespace(env: Mapping[str, str]) -> str | None:
    """The store key prefix that keeps this restart round apart from torchrun's earlier rounds,
    or None where the process group's own store needs none.

    torchrun's elastic agent hosts one TCPStore for its whole life and every round of workers
    joins it at the same ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``), with
    no per-round prefix. The keys a round's ``init_process_group`` writes (gloo publishes each
    rank's listening address under ``default_pg/0//cpu//0/<rank>``) outlive it, so after a
    restart a rank can read a dead peer's address before the peer has written its new one, and
    gloo's ``connectFullMesh`` fails (connection refused, or a connect timeout).

    ``TORCHELASTIC_RESTART_COUNT`` names the round, but only one agent's count is the same on
    every rank: an agent restarted by another node's membership change does not count it. So a
    prefix is returned only when the whole world is one agent's (``GROUP_WORLD_SIZE`` 1); with
    several nodes, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every round a new store
    instead (docs/resilience.md, "Restarting after a failure").
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE") != "1":
        return None
    return f"forge/restart_{int(env.get('TORCHELASTIC_RESTART_COUNT', '0'))}/"


def shared_store_problem(env: Mapping[str, str]) -> str | None:
    """Why this torchrun launch could not restart, or None.

    With several agents (``--nnodes`` > 1) and restarts allowed (``--max-restarts`` > 0),
    torchrun shares its rendezvous store across restart rounds unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is in the agents' environment; the ranks of a
    restarted round then read the dead round's addresses (``restart_namespace``), and no
    prefix can keep the rounds apart, because each agent counts its own restarts. The
    variable must be set where torchrun starts, so a worker can only refuse, at the first
    launch rather than at the first restart.
    """
    shares = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    agents = int(env.get("GROUP_WORLD_SIZE", "1") or 1)
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if not (shares and agents > 1 and restarts > 0):
        return None
    return (
        f"torchrun with {agents} nodes and --max-restarts={restarts} keeps one rendezvous store "
        "across restarts, where a restarted round would read the dead round's addresses: "
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun on every node (or launch "
        "with --max-restarts=0)"
    )


def local_gpu_problem(local_rank: int, gpus: int) -> str | None:
    """Why a rank of a GPU node has no GPU of its own (its local rank past the GPUs it sees),
    or None; ``gpus`` 0 is a CPU run."""
    if gpus == 0 or local_rank < gpus:
        return None
    return (
        f"local rank {local_rank} has no GPU of its own ({gpus} visible to it): start at most "
        f"{gpus} ranks per node, and let every rank see the node's GPUs (SLURM: "
        "--gpus-per-node, not --gpus-per-task; forge takes cuda:<local rank>)"
    )


def world_info(env: Mapping[str, str]) -> WorldInfo:
    """torchrun's variables win; else SLURM's (one task per rank under srun); else one process."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return WorldInfo(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env["WORLD_SIZE"]),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            launcher="torchrun",
            store_prefix=restart_namespace(env),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return WorldInfo(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            world_size=int(env["SLURM_NTASKS"]),
            master_addr=env.get("MASTER_ADDR")
            or first_host(env.get("SLURM_JOB_NODELIST", "localhost")),
            master_port=int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0"))),
            launcher="slurm",
        )
    return WorldInfo()


MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@attrs.frozen
class MeshDims:
    """Resolved sizes of each mesh dim (their product is the world size)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1  # context parallelism: ranks that split each sequence between them
    tp: int = 1
    ep: int = 1  # expert parallelism: a split of dp_shard, not a factor of the world size

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def token_slices(self) -> int:
        """Ranks that hold distinct tokens of a step: ``dp × cp`` (the loss counts over them)."""
        return self.dp * self.cp

    @property
    def dp_shard_mod_ep(self) -> int:
        """The ``dp_shard`` ranks that hold the same experts: ``dp_shard / ep``."""
        return self.dp_shard // self.ep if self.ep > 1 else self.dp_shard

    def expert_named(self) -> tuple[tuple[str, int], ...]:
        """``named()`` with ``dp_shard`` split into ``dp_shard_mod_ep × ep``, outer first (so
        that an expert-parallel group is ``ep`` consecutive ``dp_shard`` ranks)."""
        out: list[tuple[str, int]] = []
        for name, size in self.named():
            if name == "dp_shard":
                out += [("dp_shard_mod_ep", self.dp_shard_mod_ep), ("ep", self.ep)]
            else:
                out.append((name, size))
        return tuple(out)

    @property
    def replicas_alone(self) -> bool:
        """Whether ``dp_replicate`` is the only data-parallel dim (no ``dp_shard``, no ``cp``):
        then the mesh keeps a ``dp_shard`` of size 1 (``named``)."""
        return self.dp_replicate > 1 and self.dp_shard == 1 and self.cp == 1

    def named(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the dims larger than 1, outermost first: the mesh to build. One
        size-1 dim is kept, ``dp_shard`` when ``replicas_alone``: FSDP2 shards over a 1-D
        mesh and replicates over the first dim of a 2-D one only, so replicas need the 2-D
        ``(dp_replicate, dp_shard = 1)``, HSDP whose shards are whole parameters."""
        # why HSDP and not torch's replicate (torch.distributed._composable, private): the
        # layout is HSDP's (Replicate(), Shard(0)) on the same named dims, so the replica
        # comparison, Muon, checkpoints and resumes read it as they read HSDP; FSDP2 skips the
        # reduce-scatter of one rank and all-reduces over the replicas as replicate does, and
        # frees a block's copy after its forward where replicate keeps every block's
        keep = "dp_shard" if self.replicas_alone else None
        return tuple((n, getattr(self, n)) for n in MESH_ORDER if getattr(self, n) > 1 or n == keep)


def resolve_dims(cfg: DistributedConfig, world_size: int) -> MeshDims:
    """Fill in ``dp_shard = -1`` as the rest of the world (at least 1)."""
    fixed = cfg.dp_replicate * cfg.cp * cfg.tp * cfg.pp
    shard = cfg.dp_shard if cfg.dp_shard != -1 else max(1, world_size // fixed)
    return MeshDims(
        pp=cfg.pp, dp_replicate=cfg.dp_replicate, dp_shard=shard, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep
    )


def parallel_problems(config: JobConfig, world_size: int) -> list[Problem]:
    """Every combination the world size, model and schedule cannot support, one line each."""
    d = config.distributed
    dims = resolve_dims(d, world_size)
    p: list[Problem] = []
    factors = [n for n in MESH_ORDER if n != "cp" or dims.cp > 1]  # cp named when it is set
    product = math.prod(getattr(dims, n) for n in factors)
    if product != world_size:
        p.append(
            (
                "distributed",
                f"{'*'.join(factors)} = {'*'.join(str(getattr(dims, n)) for n in factors)} = "
                f"{product}, but the world size is {world_size}; make them equal",
            )
        )
    m = config.model
    p += tensor_parallel_problems(config, dims)
    p += expert_problems(config, dims)
    if m.vlm is not None:
        for key, size in (("distributed.tp", dims.tp), ("distributed.pp", dims.pp)):
            if size > 1:
                p.append(
                    (
                        key,
                        "is not supported with a vision-language model (model.vlm) yet; "
                        "use distributed.dp_shard / dp_replicate (FSDP2, HSDP)",
                    )
                )
    p += sharded_only_problems(config, dims)
    p += pipeline_problems(config, dims)
    p += context_parallel_problems(config, dims)
    return p


def tensor_parallel_problems(config: JobConfig, dims: MeshDims) -> list[Problem]:
    """What ``distributed.tp`` must divide: the heads, the KV heads and the sequence."""
    m, p = config.model, list[Problem]()
    if dims.tp <= 1:
        return p
    if m.n_heads % dims.tp:
        p.append(("distributed.tp", f"must divide model.n_heads={m.n_heads}"))
    if m.kv_heads % dims.tp:
        p.append(("distributed.tp", f"must divide model.n_kv_heads={m.kv_heads}"))
    seq_len = config.train.seq_len
    if dims.cp == 1 and seq_len % dims.tp:
        p.append(("distributed.tp", f"must divide train.seq_len={seq_len} (sequence parallelism)"))
    elif seq_len % (dims.tp * dims.cp):  # it splits each context-parallel rank's tokens
        p.append(
            (
                "distributed.tp",
                f"must divide a context-parallel rank's tokens, train.seq_len / distributed.cp"
                f" = {seq_len / dims.cp:g} (sequence parallelism)",
            )
        )
    return p


def pipeline_problems(config: JobConfig, dims: MeshDims) -> list[Problem]:
    """What ``distributed.pp > 1`` needs: layers for every stage, what the schedule needs of
    the stages per rank and the micro-batches (``forge.parallel.stages``), eval steps in whole
    groups; what it cannot export, compile or tie."""
    d, m, p = config.distributed, config.model, list[Problem]()
    if dims.pp <= 1:
        needless = {"pp_stages_per_rank": d.pp_stages_per_rank != 1,
                    "pp_stage_boundaries": bool(d.pp_stage_boundaries)}  # fmt: skip
        for key in (k for k, set_ in needless.items() if set_):
            p.append((f"distributed.{key}", "needs distributed.pp > 1 (pipeline stages)"))
        return p
    if config.checkpoint.export_final:
        p.append(
            (
                "checkpoint.export_final",
                "is not supported with distributed.pp > 1; export afterwards with "
                "scripts/convert_checkpoint.py",
            )
        )
    p += schedule_problems(
        d.pp_schedule, dims.pp, d.pp_stages_per_rank, config.train.grad_accum_steps
    )
    if config.eval.interval > 0 and config.eval.steps < config.train.grad_accum_steps:
        p.append(
            (
                "eval.steps",
                f"must be >= train.grad_accum_steps={config.train.grad_accum_steps} "
                "under distributed.pp > 1 (eval batches go through the pipeline in groups)",
            )
        )
    stages = dims.pp * d.pp_stages_per_rank
    if m.n_layers < stages:
        p.append(("distributed.pp", f"needs model.n_layers >= {stages} stages, got {m.n_layers}"))
    elif d.pp_stage_boundaries:
        for problem in boundary_problems(d.pp_stage_boundaries, m.n_layers, stages):
            p.append(("distributed.pp_stage_boundaries", problem))
    p += schedule_feature_problems(config, dims)
    return p


def schedule_feature_problems(config: JobConfig, dims: MeshDims) -> list[Problem]:
    """What a schedule cannot combine with: compiled blocks under the schedules that split
    backward in two (measured: torch's compiled backward frees its buffers after the first
    half), and those schedules under FSDP2 (data or context parallelism), whose gradients
    were measured wrong."""
    kind, p = config.distributed.pp_schedule, list[Problem]()
    if kind in SPLIT_BACKWARD and config.train.compile is True:  # unset: eager (splits_backward)
        p.append(
            (
                "train.compile",
                f"is not supported with distributed.pp_schedule='{kind.value}' (its backward "
                "runs in two halves, which torch 2.13 cannot do for compiled blocks); leave "
                "train.compile unset or false",
            )
        )
    if splits_backward(dims.pp, kind) and dims.dp * dims.cp > 1:
        # measured at pp=2 x dp_shard=2 and pp=2 x cp=2: step 1's loss equals one rank's,
        # its grad norm does not (2.397 against 2.734); tied embeddings in a V layout would
        # also put one weight in two FSDP2 units on rank 0
        p.append(
            (
                "distributed.pp_schedule",
                f"'{kind.value}' is not supported with FSDP2 (distributed.dp_replicate, "
                "dp_shard or cp > 1) yet: its backward in two halves, inputs then weights, "
                "does not yet equal one rank there; use 'gpipe', '1f1b' or 'interleaved_1f1b'",
            )
        )
    return p


def expert_problems(config: JobConfig, dims: MeshDims) -> list[Problem]:
    """What a mixture-of-experts model, or expert parallelism, cannot be combined with."""
    m, ep = config.model, config.distributed.ep
    p: list[Problem] = []
    if m.moe and dims.tp > 1 and ep > 1:
        p.append(
            (
                "distributed.tp",
                "tensor parallelism is not supported together with expert parallelism "
                "(distributed.ep > 1) yet; use one of them",
            )
        )
    if ep == 1:
        return p
    if not m.moe:
        p.append(("distributed.ep", "needs mixture-of-experts blocks (model.moe_num_experts > 0)"))
        return p
    if dims.dp_shard % ep:
        p.append(
            (
                "distributed.ep",
                f"must divide distributed.dp_shard (resolved {dims.dp_shard}): the experts are "
                "split over groups of ep consecutive dp_shard ranks",
            )
        )
    if m.moe_num_experts % ep:
        p.append(("distributed.ep", f"must divide model.moe_num_experts={m.moe_num_experts}"))
    return p


def context_parallel_problems(config: JobConfig, dims: MeshDims) -> list[Problem]:
    """What ``distributed.cp > 1`` needs (``train.seq_len`` in ``2 × cp`` equal chunks, for
    the head–tail split) and what it is not combined with yet, one line each naming the key."""
    m, p = config.model, list[Problem]()
    if dims.cp <= 1:
        return p
    seq_len = config.train.seq_len
    if seq_len % (2 * dims.cp):
        p.append(
            (
                "distributed.cp",
                f"2*cp = {2 * dims.cp} must divide train.seq_len={seq_len} (each rank keeps a "
                "head and a tail chunk of every sequence)",
            )
        )
    unsupported = (
        ("model.vlm", m.vlm is not None, "a vision-language model"),
        ("model.moe_num_experts", m.moe, "mixture-of-experts blocks (per-rank routing)"),
    )
    for key, present, what in unsupported:
        if present:
            p.append((key, f"{what} is not supported with distributed.cp > 1 yet"))
    if m.attention.value in ("flex", "varlen"):
        p.append(
            (
                "model.attention",
                f"'{m.attention.value}' is not supported with distributed.cp > 1 (its "
                "gathered keys run forge's own attention); set 'auto' or 'sdpa'",
            )
        )
    return p
