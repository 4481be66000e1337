"""What ``load_and_validate_config`` checks against the world beyond the config file: the
data on disk, the freeze schedule against the model, the Hugging Face family the model
exports as, the machine's memory and its precision support."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

import attrs
import torch

from forge.config.freeze import schedule_problems
from forge.config.sections import JobConfig, Precision
from forge.data.shards import DataError, Manifest, read_manifest
from forge.errors import UserInputError
from forge.interop.export_rules import export_problem
from forge.model.attention import attention_problem
from forge.model.vlm import build_model
from forge.optim.freezing import named_parameters
from forge.parallel.memory_plan import GIB, MemoryPlan, memory_plan
from forge.parallel.world import WorldInfo, resolve_dims
from forge.resilience.replica_groups import lighthouse_address, lighthouse_problem, torchft_problem
from forge.training.setup.vlm import vision_footprint


def freeze_problems(config: JobConfig) -> list[str]:
    """What ``[[freeze]]`` cannot do to this model (checked on the meta device: no memory)."""
    if not config.freeze:
        return []
    with torch.device("meta"):
        names = list(named_parameters(build_model(config.model)))
    return schedule_problems(names, config.freeze)


def export_final_problems(config: JobConfig) -> list[str]:
    """``checkpoint.export_final`` of a model no Hugging Face family holds, refused before
    anything is built rather than after the run trained (the export's own check,
    ``forge.interop.export_rules.export_problem``, which the config package is below)."""
    if not config.checkpoint.export_final:
        return []
    problem = export_problem(config.model)
    return [] if problem is None else [f"checkpoint.export_final: {problem}, or set it off"]


def attention_problems(config: JobConfig, cuda: bool | None = None) -> list[str]:
    """``model.attention`` against the device the run trains on (a GPU when ``cuda``; None:
    when torch sees one) and its compute dtype: one line naming the key, before anything is
    built."""
    device = "cuda" if (torch.cuda.is_available() if cuda is None else cuda) else "cpu"
    bf16 = config.train.mixed_precision is Precision.BF16
    problem = attention_problem(config.model, device, bf16)
    return [] if problem is None else [problem]


def data_problems(config: JobConfig) -> list[str]:
    """Every data source exists and fits the model: manifests readable, ids within the vocab."""
    problems: list[str] = []
    key_of = {s.name: f"data.sources.{s.name}.path" for s in config.data.sources}
    first: Manifest | None = None
    for source in config.data.source_list:
        key = key_of.get(source.name, "data.path")
        folder = pathlib.Path(source.path)
        try:
            manifest = read_manifest(folder)
        except DataError as exc:
            problems += [f"{key}: {line}" for line in exc.lines]
            continue
        first = first or manifest
        if manifest.tokenizer != first.tokenizer:
            problems.append(
                f"{key}: {folder} was tokenized with {manifest.tokenizer}, the first source with "
                f"{first.tokenizer}; every source must use one tokenizer"
            )
        if manifest.vocab_size > config.model.vocab_size:
            problems.append(
                f"model.vocab_size: {config.model.vocab_size} is smaller than the dataset's "
                f"vocab size {manifest.vocab_size} ({folder}); token ids would fall outside "
                f"the embedding; set model.vocab_size >= {manifest.vocab_size}"
            )
        if config.data.pack_documents and "bos_id" not in manifest.tokenizer:
            problems.append(
                f"data.pack_documents: {folder}'s manifest names no bos_id to split documents "
                "at; re-prepare it with scripts/prepare_data.py"
            )
    return problems


def replica_group_problems(config: JobConfig, env: Mapping[str, str]) -> list[str]:
    """``[fault_tolerance]`` against the machine: torchft installed, a lighthouse named and
    answering (every rank of the group asks: each talks to it or to its group's manager);
    with it off, none of its keys set (``unread_keys``)."""
    if not config.fault_tolerance.enabled:
        return [f"{key}: {message}" for key, message in config.fault_tolerance.unread_keys()]
    if (problem := torchft_problem()) is not None:
        return [problem]
    try:
        address = lighthouse_address(config.fault_tolerance, dict(env))
    except UserInputError as exc:
        return exc.lines
    if (problem := lighthouse_problem(address)) is not None:
        advice = (
            ""
            if problem.startswith("'")
            else (
                "; start it first (`python scripts/lighthouse.py`) and pass the address it prints"
            )
        )
        return [f"fault_tolerance.lighthouse: {problem}{advice}"]
    return []


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (empty elsewhere)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


# data.verify_checksum = false, said at each launch: what the run then cannot see
UNVERIFIED_DATA = (
    "warning: data.verify_checksum = false: the shards' bytes are not compared with their "
    "manifest's SHA-256, so a shard rewritten in place goes unseen (the run's data identity "
    "and data/rows_digest follow the manifest and the rows' positions, not their bytes)"
)


def precision_warning(precision: Precision, device: str, flags: frozenset[str]) -> str | None:
    """A warning when bf16 compute would be emulated: on a CPU without AVX-512 BF16 or AMX,
    a bf16 step ran 24x slower than fp32 (benchmarks/precision.py)."""
    if precision is not Precision.BF16 or device != "cpu" or not flags:
        return None
    if flags & {"avx512_bf16", "amx_bf16"}:
        return None
    return (
        "train.mixed_precision='bf16' on a CPU without AVX-512 BF16 / AMX is emulated and much "
        "slower than fp32; set --train.mixed_precision=fp32"
    )


@attrs.frozen
class MemoryCapacity:
    """What one rank can allocate, in bytes, and where the figure comes from (for messages)."""

    bytes: int
    source: str


# (the part of the estimate, the key to change first, the way to make it smaller)
MEMORY_PARTS = (
    (
        "the weights, gradients and optimizer state",
        "model.dim",
        "a smaller model (model.dim, model.n_layers, model.vocab_size) or more ranks to "
        "shard it over (distributed.dp_shard)",
    ),
    (
        "the activations",
        "train.batch_size",
        "fewer tokens per micro-batch (train.batch_size, train.seq_len) or "
        "train.activation_checkpointing",
    ),
    ("the loss buffers", "train.loss_chunk_size", "a chunked loss (train.loss_chunk_size)"),
    (
        "the RoPE tables",
        "model.max_seq_len",
        "a model.max_seq_len no longer than the sequences you train on and generate",
    ),
)


def memory_problem(plan: MemoryPlan, capacity: MemoryCapacity) -> str | None:
    """Why the run cannot be allocated, if its estimated peak exceeds what a rank has: the
    figures, the largest part and the keys that shrink it."""
    if plan.total <= capacity.bytes:
        return None
    parts = (
        plan.parameters
        + plan.gradients
        + plan.optimizer_state
        + plan.optimizer_step
        + plan.gathered_weights,
        plan.activations,
        plan.loss,
        plan.buffers,
    )
    size, (part, key, advice) = max(zip(parts, MEMORY_PARTS, strict=True), key=lambda p: p[0])
    return (
        f"{key}: this run needs an estimated {plan.total / GIB:,.1f} GiB per rank, more than "
        f"{capacity.source}; {part} take {size / GIB:,.1f} GiB of it: choose {advice} "
        "(scripts/plan.py shows the estimate part by part)"
    )


def host_memory_bytes() -> int | None:
    """This host's memory, or the container's limit when that is lower (cgroup v2)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    try:
        limit = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def ranks_on_host(env: Mapping[str, str]) -> int:
    """How many ranks share this host's memory (torchrun's or SLURM's count; else 1)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        leading = env.get(name, "").split("(")[0].split(",")[0]
        if leading.isdigit() and int(leading) > 0:
            return int(leading)
    return 1


def memory_capacity(env: Mapping[str, str], local_rank: int) -> MemoryCapacity | None:
    """The local GPU's memory, or a rank's share of this host's; None when unknown."""
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        total = torch.cuda.get_device_properties(index).total_memory
        return MemoryCapacity(total, f"the {total / GIB:,.1f} GiB of cuda:{index}")
    host = host_memory_bytes()
    if host is None:
        return None
    ranks = ranks_on_host(env)
    share = f"a 1/{ranks} share " if ranks > 1 else ""
    return MemoryCapacity(host // ranks, f"{share}this host's {host / GIB:,.1f} GiB")


def memory_problems(config: JobConfig, world: WorldInfo) -> list[str]:
    """The run's per-rank memory estimate against what a rank has (needs a sound layout and
    model); nothing where the machine's memory is unknown."""
    capacity = memory_capacity(os.environ, world.local_rank)
    if capacity is None:
        return []
    dims = resolve_dims(config.distributed, world.world_size)
    problem = memory_problem(memory_plan(config, dims, vision_footprint(config.model)), capacity)
    return [problem] if problem else []
