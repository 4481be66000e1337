"""What the operating system and the machine cannot take, refused at validation: paths it
cannot name, runs it cannot allocate, token ids past the vocabulary."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from forge.config.ranges import usable_path
from forge.data.shards import DataError, check_token_ids
from forge.parallel.memory_plan import GIB, MemoryPlan
from forge.training.setup.problems import MemoryCapacity, memory_problem, ranks_on_host

# (path, the problem's text, or None when the path is usable)
PATHS = [
    (None, None),
    ("", None),  # empty is not_empty's to refuse
    ("runs/debug", None),
    ("/" + "a" * 255, None),
    ("/" + "a" * 256, "the name 'aaaaaaaaaaaaaaaaaaaaaaaa...' is 256 bytes long"),
    ("runs/" + "é" * 128, "is 256 bytes long"),  # bytes, not characters
    ("/".join(["d" * 200] * 25), "bytes long, over the 4095 a path may be"),
    ("runs/a\0b", "contains a NUL byte"),
]


@pytest.mark.parametrize("path,problem", PATHS)
def test_a_path_the_os_cannot_name_is_refused_naming_why(path, problem):
    problems: list[tuple[str, str]] = []
    usable_path(problems, "run.dir", path)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0][0] == "run.dir"
        assert problem in problems[0][1]


def plan(**parts: int) -> MemoryPlan:
    sizes = dict(
        parameters=0, gradients=0, optimizer_state=0, gathered_weights=0, activations=0,
        activations_without_ac=0, loss=0, buffers=0,
    )  # fmt: skip
    return MemoryPlan(**{**sizes, **parts})


HOST = MemoryCapacity(24 * GIB, "this host's 24.0 GiB")

# (plan, the key the refusal names first, the part it blames; None: it fits)
PLANS = [
    (plan(parameters=GIB, activations=GIB), None, None),
    (plan(parameters=24 * GIB), None, None),  # exactly the capacity still fits
    (plan(parameters=10 * GIB, gradients=10 * GIB, optimizer_state=20 * GIB), "model.dim", "the weights"),
    (plan(parameters=GIB, activations=30 * GIB), "train.batch_size", "the activations"),
    (plan(loss=25 * GIB), "train.loss_chunk_size", "the loss buffers"),
    (plan(buffers=2**62), "model.max_seq_len", "the RoPE tables"),
]  # fmt: skip


@pytest.mark.parametrize("memory,key,part", PLANS)
def test_a_run_past_the_machines_memory_is_refused_naming_its_largest_part(memory, key, part):
    problem = memory_problem(memory, HOST)
    if key is None:
        assert problem is None
        return
    assert problem is not None and problem.startswith(f"{key}: this run needs an estimated")
    assert f"{memory.total / GIB:,.1f} GiB per rank, more than this host's 24.0 GiB" in problem
    assert f"{part}" in problem and "scripts/plan.py" in problem


# (environment, ranks sharing this host's memory)
RANKS = [
    ({}, 1),
    ({"LOCAL_WORLD_SIZE": "4"}, 4),
    ({"SLURM_NTASKS_PER_NODE": "8"}, 8),
    ({"SLURM_NTASKS_PER_NODE": "2(x3)"}, 2),
    ({"SLURM_NTASKS_PER_NODE": "4,2"}, 4),
    ({"LOCAL_WORLD_SIZE": "0"}, 1),
    ({"LOCAL_WORLD_SIZE": "x", "SLURM_NTASKS_PER_NODE": "3"}, 3),
]


@pytest.mark.parametrize("env,ranks", RANKS)
def test_the_ranks_sharing_a_host_come_from_the_launcher(env, ranks):
    assert ranks_on_host(env) == ranks


def test_a_shard_id_past_the_vocab_is_refused_naming_the_token(monkeypatch):
    monkeypatch.setattr("forge.data.shards.ID_CHECK_CHUNK", 7)  # the culprit in a later chunk
    tokens = np.arange(50, dtype=np.uint16) % 10
    check_token_ids(pathlib.Path("s.bin"), tokens, 10)  # every id below the vocab: accepted
    tokens[33] = 10
    with pytest.raises(DataError, match=r"s.bin: token 33 is id 10, outside .* vocab_size 10"):
        check_token_ids(pathlib.Path("s.bin"), tokens, 10)


def test_a_config_file_name_the_os_cannot_take_is_one_config_error():
    from forge.config.loader import ConfigError, load_config

    with pytest.raises(ConfigError, match="is 300 bytes long"):
        load_config(["/tmp/" + "c" * 295 + ".toml"])
