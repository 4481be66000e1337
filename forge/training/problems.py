"""What ``load_and_validate_config`` checks against the world beyond the config file: the
data on disk, the freeze schedule against the model, and the machine's precision support."""

from __future__ import annotations

import pathlib

import torch

from forge.config.freeze import schedule_problems
from forge.config.sections import JobConfig, Precision
from forge.data.shards import DataError, Manifest, read_manifest
from forge.model.vlm import build_model
from forge.optim.freezing import named_parameters


def freeze_problems(config: JobConfig) -> list[str]:
    """What ``[[freeze]]`` cannot do to this model (checked on the meta device: no memory)."""
    if not config.freeze:
        return []
    with torch.device("meta"):
        names = list(named_parameters(build_model(config.model)))
    return schedule_problems(names, config.freeze)


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
