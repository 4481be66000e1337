"""Resilience at 2 ranks (gloo, CPU): every rank takes the same branch. Real ranks
(``tests/ranks.py``), each rank's own exit code checked where that is the point (a signalled
rank's and its peer's, a full disk's); what torchrun makes of its workers' exits:
tests/e2e/test_save_faults.py and test_torchrun_restart.py."""

from __future__ import annotations

import json
import math
import os
import re
import time

import pytest
import torch

from tests.conftest import OPT_IN, REPO
from tests.distributed.test_equivalence import records, weights, write_config
from tests.ranks import every_exit_code, run_ranks

FSDP = ["--distributed.dp_shard=2", "--train.batch_size=2", "--train.grad_accum_steps=2"]
COMMON = [
    "--train.max_steps=6",
    "--scheduler.decay_steps=8",
    "--data.verify_checksum=false",
    "--distributed.timeout_s=60",
    "--resilience.health_timeout_s=30",
]


def two_ranks(config, run_dir, *args, faults="", timeout=240):
    argv = [str(REPO / "scripts" / "train.py"), str(config), f"--run.dir={run_dir}", *COMMON, *args]
    start = time.monotonic()
    out = run_ranks(2, argv, env={"FORGE_FAULTS": faults}, timeout=timeout)
    return out, time.monotonic() - start


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, small_corpus):
    """The 6-step FSDP run the interrupted ones must reproduce."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    config = write_config(tmp, small_corpus)
    ok(two_ranks(config, tmp / "ref", *FSDP)[0])
    assert not (tmp / "ref" / "stacks").exists()  # a healthy run keeps no stacks
    return config, tmp / "ref"


def ok(out):
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]


# default CI: the synchronous save; the async modes opt-in (each mode's emergency save at 2
# ranks under torchrun: tests/e2e/test_save_faults.py; its exact resume: test_train_script.py)
@pytest.mark.parametrize(
    "mode",
    ["disabled", pytest.param("async", marks=OPT_IN), pytest.param("async_process", marks=OPT_IN)],
)
def test_sigterm_on_one_rank_stops_both_at_the_same_step_and_resume_is_exact(
    uninterrupted, tmp_path, mode
):
    config, ref = uninterrupted
    run = tmp_path / "run"
    saves = f"--checkpoint.async_mode={mode}"
    argv = [str(REPO / "scripts" / "train.py"), str(config), f"--run.dir={run}", *COMMON]
    codes, _, err = every_exit_code(
        2, [*argv, *FSDP, saves], env={"FORGE_FAULTS": "signal:step=3:rank=1"}, timeout=240
    )
    assert codes == [75, 75], err[-3000:]  # both ranks SHUTDOWN, the one signalled and its peer
    # delivered after step 3's control word: both ranks see it at the end of step 4
    step4 = run / "checkpoints" / "step_4"
    assert json.loads((step4 / "train_state.json").read_text())["reason"] == "emergency"
    assert (step4 / "rng_rank0.pt").is_file() and (step4 / "rng_rank1.pt").is_file()
    assert os.readlink(run / "checkpoints" / "latest") == "step_4"
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4]
    ok(two_ranks(config, run, *FSDP, saves)[0])
    assert [(r["step"], r["loss"]) for r in records(run)] == [
        (r["step"], r["loss"]) for r in records(ref)
    ]
    ref_w, got_w = weights(config, ref, 6), weights(config, run, 6)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)


def test_nan_on_one_rank_rolls_back_both_ranks_together(tmp_path, small_corpus):
    config = write_config(tmp_path, small_corpus)
    args = [*FSDP, "--resilience.on_nonfinite=rollback", "--resilience.snapshot_interval=2"]
    one, both = tmp_path / "one", tmp_path / "both"
    ok(two_ranks(config, one, *args, faults="nan:step=3:rank=1")[0])
    ok(two_ranks(config, both, *args, faults="nan:step=3")[0])
    steps = [r["step"] for r in records(one)]
    assert steps == [1, 2, 3, 3, 4, 5, 6]  # step 3 failed, rolled back to 2, ran again
    assert steps == [r["step"] for r in records(both)]
    assert math.isnan(records(one)[2]["loss"])
    state = json.loads((one / "checkpoints" / "step_6" / "train_state.json").read_text())
    assert state["loop_state"]["skipped_ranges"] == [[3, 3]]
    w_one, w_both = weights(config, one, 6), weights(config, both, 6)
    assert all(torch.equal(w_one[k], w_both[k]) for k in w_one)


def test_stalled_rank_ends_in_health_failure_without_hanging(tmp_path, small_corpus):
    config = write_config(tmp_path, small_corpus)
    args = [*FSDP, "--distributed.timeout_s=4", "--resilience.health_timeout_s=4"]
    out, elapsed = two_ranks(
        config, tmp_path / "run", *args, faults="stall:step=2:rank=1:seconds=9", timeout=120
    )
    assert out.returncode == 4, out.stderr[-3000:]  # HEALTH_FAILURE's exit code
    assert "HEALTH_FAILURE at step 3" in out.stdout  # step 3 timed out
    for rank in (0, 1):  # one line each, naming the rank and the collective
        lines = [x for x in out.stderr.splitlines() if f"[forge] error: rank {rank}:" in x]
        assert len(lines) == 1, out.stderr[-3000:]
        assert re.search(r"rank \d: \w+ #\d+ in step 3 failed or outlasted distributed", lines[0])
    assert elapsed < 60, elapsed
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == []
    # where each rank was: rank 1 asleep in the stall (its watchdog); rank 0 names step 3's
    # collective, then its stacks as it caught the failure; the error lines name the folder
    stacks = tmp_path / "run" / "stacks"
    assert f"each rank's stacks: {stacks}/rank<R>.txt" in lines[0]
    asleep = (stacks / "rank1.txt").read_text()
    assert "Timeout (0:00:04)!" in asleep and "faults.py" in asleep and "on_step_end" in asleep
    waiting = (stacks / "rank0.txt").read_text()
    assert re.search(r"rank 0: \w+ #\d+ in step 3 failed or outlasted", waiting), waiting
    assert "in guarded" in waiting  # its stacks, dumped where guard_collectives caught it


def test_a_rank_that_dies_of_sigsegv_prints_its_native_and_python_stacks(tmp_path, small_corpus):
    """With faulthandler on (every rank ``run_ranks`` starts has it), a rank ended by a fatal
    signal prints every thread's C++ frames (torch's handler), then its Python stack; the
    peer ends HEALTH_FAILURE with its one line."""
    config = write_config(tmp_path, small_corpus)
    argv = [str(REPO / "scripts" / "train.py"), str(config), f"--run.dir={tmp_path / 'run'}",
            *COMMON, *FSDP]  # fmt: skip
    env = {"FORGE_FAULTS": "signal:step=2:rank=1:sig=SEGV"}
    codes, _, err = every_exit_code(2, argv, env=env, timeout=120)
    assert codes == [4, -11], err[-3000:]
    native = err.index("SIGSEGV(11), PID: ")
    assert "frame #" in err[native:] and "libc10" in err[native:]
    python = err.index("Fatal Python error: Segmentation fault", native)
    assert "faults.py" in err[python:]  # the rank's Python stack: it signalled itself there


REPLAY = [*FSDP, "--resilience.replay_interval=1", "--checkpoint.interval=1"]


def test_a_corrupted_gradient_is_outvoted_and_the_run_is_the_uninterrupted_one(
    tmp_path, uninterrupted
):
    """One flipped gradient bit on rank 1 at step 3, every step replayed: the third
    computation outvotes it, one warning names rank 1 and step 3, and every loss is
    bit-identical to the run that had no fault (and replayed only its first step)."""
    config, ref = uninterrupted
    out, _ = two_ranks(config, tmp_path / "run", *REPLAY, faults="corrupt:step=3:rank=1")
    ok(out)
    warned = [x for x in out.stderr.splitlines() if "computed differently" in x]
    assert len(warned) == 1 and "step 3" in warned[0] and "rank 1 (host " in warned[0], warned
    assert [r["loss"] for r in records(tmp_path / "run")] == [r["loss"] for r in records(ref)]
    mismatches = [r["resilience/replay_mismatches"] for r in records(tmp_path / "run")]
    assert mismatches == [0, 0, 1, 1, 1, 1]


def test_a_rank_that_computes_three_ways_ends_the_run_with_6_and_no_later_checkpoint(
    tmp_path, small_corpus
):
    config = write_config(tmp_path, small_corpus)
    faults = "corrupt:step=3:rank=1:times=3"
    out, _ = two_ranks(config, tmp_path / "run", *REPLAY, faults=faults)
    assert out.returncode == 6, out.stderr[-3000:]
    errors = [x for x in out.stderr.splitlines() if "[forge] error: step 3 came out" in x]
    assert len(errors) == 1 and "rank 1 (host " in errors[0] and "suspect its hardware" in errors[0]
    assert "REPLAY_MISMATCH at step 3" in out.stdout
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == ["step_1", "step_2"]


def test_replicas_whose_gradients_differ_end_the_run_with_6(tmp_path, small_corpus):
    """HSDP at 4 ranks (2 replicas of 2 shards): rank 1 flips the same gradient bit in every
    computation of step 2, so its own replay agrees with itself; its replica (rank 3) holds
    other gradients, and with two there is no majority: both are named, exit 6."""
    config = write_config(tmp_path, small_corpus)
    argv = [str(REPO / "scripts" / "train.py"), str(config), f"--run.dir={tmp_path / 'run'}",
            *COMMON, "--distributed.dp_replicate=2", "--distributed.dp_shard=2",
            "--train.batch_size=1", "--train.grad_accum_steps=2", *REPLAY[1:]]  # fmt: skip
    faults = "corrupt:step=2:rank=1:times=3:sticky=1"
    out = run_ranks(4, argv, env={"FORGE_FAULTS": faults}, timeout=240)
    assert out.returncode == 6, out.stderr[-3000:]
    errors = [x for x in out.stderr.splitlines() if "[forge] error: at step 2" in x]
    assert len(errors) == 1 and "ranks 1 (host " in errors[0] and ", 3 (host " in errors[0]
    assert "came out three different ways" not in out.stderr  # each replay agreed with itself
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == ["step_1"]


def test_replicas_alone_hold_whole_parameters_and_a_persistent_fault_ends_with_6(
    tmp_path, small_corpus
):
    """``dp_replicate=2, dp_shard=1`` at 2 ranks: each replica holds every parameter whole
    (the step-1 checkpoint has one chunk per tensor, where ``dp_shard=2`` has two), so the
    comparison of replicas has something to compare: rank 1 flips the same gradient bit in
    every computation of step 2, and with two replicas both are named, exit 6."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    config = write_config(tmp_path, small_corpus)
    replicas = ["--distributed.dp_replicate=2", "--distributed.dp_shard=1"]
    faults = "corrupt:step=2:rank=1:times=3:sticky=1"
    out, _ = two_ranks(config, tmp_path / "run", *REPLAY, *replicas, faults=faults)
    assert out.returncode == 6, out.stderr[-3000:]
    errors = [x for x in out.stderr.splitlines() if "[forge] error: at step 2" in x]
    assert len(errors) == 1 and "ranks 0 (host " in errors[0] and ", 1 (host " in errors[0]
    saved = tmp_path / "run" / "checkpoints" / "step_1"
    meta = FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    chunks = {k: len(m.chunks) for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    assert any(k.startswith("model.") for k in chunks), sorted(chunks)
    assert set(chunks.values()) == {1}, chunks


def test_a_slow_rank_is_named_in_every_record_and_in_one_warning(tmp_path, uninterrupted):
    config, _ = uninterrupted
    args = [*FSDP, "--resilience.straggler_logs=3", "--resilience.straggler_ratio=1.3"]
    out, _ = two_ranks(config, tmp_path / "run", *args, faults="slow:step=1:rank=1:seconds=0.4")
    ok(out)
    recs = records(tmp_path / "run")
    assert [r["straggler/slowest_rank"] for r in recs] == [1] * 6
    # 0.4 s more CPU time than a step's own (about 0.4 s here, twice that in the replayed
    # first step): a ratio near 2, 1.5 at step 1 (1.28 seen on a loaded machine, whose step
    # took longer); the waits of rank 0 count for nothing
    ratios = {r["step"]: r["straggler/ratio"] for r in recs}
    assert ratios[1] > 1.1 and all(ratios[s] > 1.3 for s in range(2, 7)), ratios
    warned = [x for x in out.stderr.splitlines() if "is a straggler" in x]
    assert len(warned) == 1 and warned[0].startswith("[forge] warning: rank 1 (host "), warned


def test_a_rank_waiting_on_its_own_data_is_named_a_straggler(tmp_path, uninterrupted):
    """Rank 1's batches come 0.4 s late (it sleeps, as on a slow disk): its CPU clock sees
    nothing, rank 0 waits for it in the step's collectives spending none either; its wait
    for its own data is what names it."""
    config, _ = uninterrupted
    args = [*FSDP, "--resilience.straggler_logs=3", "--resilience.straggler_ratio=1.3"]
    faults = "slow_data:step=2:rank=1:seconds=0.4"
    out, _ = two_ranks(config, tmp_path / "run", *args, faults=faults)
    ok(out)
    ratios = {r["step"]: r["straggler/ratio"] for r in records(tmp_path / "run")}
    slowest = {r["step"]: r["straggler/slowest_rank"] for r in records(tmp_path / "run")}
    assert all(slowest[s] == 1 and ratios[s] > 1.3 for s in range(2, 7)), (slowest, ratios)
    warned = [x for x in out.stderr.splitlines() if "is a straggler" in x]
    assert len(warned) == 1 and warned[0].startswith("[forge] warning: rank 1 (host "), warned


def test_a_held_run_dir_stops_both_ranks_at_start_up(tmp_path, small_corpus):
    """Only rank 0 takes the lock; rank 1 learns of the refusal and never trains alone."""
    from forge.training.records.run_dir import lock_directories

    config = write_config(tmp_path, small_corpus)
    run_dir = tmp_path / "run"
    held = lock_directories([("run.dir", run_dir)])
    try:
        out, elapsed = two_ranks(config, run_dir, *FSDP)
    finally:
        held.release()
    assert out.returncode != 0
    errors = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 2, out.stderr[-3000:]  # one line from each rank, the same
    assert all(f"is in use by pid {os.getpid()}" in e for e in errors)
    assert not (run_dir / "metrics.jsonl").exists()
    assert elapsed < 120  # no rank waited for a collective its peer never entered


def test_a_full_disk_at_two_ranks_fails_both_alike_and_keeps_the_last_checkpoint(
    tmp_path, small_corpus
):
    config = write_config(tmp_path, small_corpus)
    run_dir = tmp_path / "run"
    args = [*FSDP, "--checkpoint.interval=3", "--checkpoint.async_mode=async"]
    ok(two_ranks(config, run_dir, *args, "--train.max_steps=3")[0])

    argv = [str(REPO / "scripts" / "train.py"), str(config), f"--run.dir={run_dir}", *COMMON]
    codes, _, stderr = every_exit_code(2, [*argv, *args], timeout=240, file_size_limit=50_000)
    assert codes == [5, 5], stderr[-4000:]
    errors = [x for x in stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 2 and all("saving step 6 failed" in e for e in errors), stderr[-4000:]
    assert "Traceback" not in stderr and "OSError" in errors[0]
    ckpt = run_dir / "checkpoints"
    assert os.readlink(ckpt / "latest") == "step_3"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_3"]


ONE_RANK_CANNOT_CHECKSUM = """
import pathlib, sys
import torch, torch.distributed as dist
from forge.checkpoint import checksum_writer
from forge.checkpoint.checkpointer import Checkpointer
from forge.config.sections import AsyncMode
from forge.errors import CheckpointSaveError

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:  # this rank's disk fails while its shard is read back for the checksum
    def broken(path, offset, length):
        raise OSError(5, "Input/output error")
    checksum_writer.crc_of_range = broken
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters())
saver = Checkpointer(pathlib.Path(sys.argv[1]), AsyncMode.DISABLED, rank, 2, timeout_s=60)
try:
    saver.save(1, model, opt, {"step": 1})
    print(f"rank {rank}: committed", flush=True)
except CheckpointSaveError as exc:
    print(f"rank {rank}: refused: {exc}", flush=True)
saver.close()
dist.destroy_process_group()
"""


A_PEER_STALLED_IN_AN_AGREEMENT = """
import os, pathlib, sys, time
import torch.distributed as dist
from forge.checkpoint.checkpointer import Checkpointer, PeerLostError
from forge.config.sections import AsyncMode

dist.init_process_group("gloo")
rank = dist.get_rank()
saver = Checkpointer(pathlib.Path(sys.argv[1]), AsyncMode.DISABLED, rank, 2, timeout_s=2)
if rank == 1:  # stalled, not gone: its connections stay open while rank 0 waits
    time.sleep(6)
    os._exit(0)
start = time.monotonic()
try:
    saver._gather("ready", 1)
except PeerLostError as exc:
    print(f"lost after {time.monotonic() - start:.0f} s: {exc}", flush=True)
os._exit(3)
"""


def test_a_save_s_own_groups_give_up_on_a_stalled_peer_within_the_timeout(tmp_path):
    """The checkpointer's gloo groups (DCP's and its agreements) are bounded by
    ``distributed.timeout_s``: a group made without a timeout waits 30 minutes for a peer
    that stalls (SIGSTOP, a hung disk) whatever the default group's timeout. Rank 0 gives
    up on its own timeout while rank 1 still sleeps (the error is gloo's timeout, not a
    connection closed by a peer that exited)."""
    script = tmp_path / "agree.py"
    script.write_text(A_PEER_STALLED_IN_AN_AGREEMENT)
    out = run_ranks(2, [str(script), str(tmp_path / "ckpt")], env={"PYTHONPATH": str(REPO)},
                    timeout=120)  # fmt: skip
    assert out.returncode == 3, out.stdout + out.stderr[-3000:]
    assert "lost after" in out.stdout and "Timed out" in out.stdout, out.stdout


def test_a_checksum_that_fails_on_one_rank_fails_the_save_on_both(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(ONE_RANK_CANNOT_CHECKSUM)
    out = run_ranks(2, [str(script), str(tmp_path / "ckpt")], env={"PYTHONPATH": str(REPO)},
                    timeout=120)  # fmt: skip
    ok(out)
    for rank in (0, 1):  # both took the same branch: neither hung nor committed
        assert f"rank {rank}: refused:" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "Input/output error" in out.stdout
    assert not (tmp_path / "ckpt" / "step_1").exists()


def test_two_ranks_save_to_s3_and_resume_as_the_uninterrupted_local_run(
    tmp_path, small_corpus, s3_bucket
):
    """Each rank uploads its own shards and checksums what it wrote; rank 0 commits. The
    resumed run's losses are the local uninterrupted run's, bit for bit."""
    config = write_config(tmp_path, small_corpus)
    ref, _ = two_ranks(config, tmp_path / "ref", *FSDP)
    assert ref.returncode == 0, ref.stderr[-3000:]
    url = [f"--checkpoint.dir=s3://{s3_bucket}/run", "--checkpoint.interval=2"]
    first, _ = two_ranks(config, tmp_path / "run", *FSDP, *url, "--train.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    second, _ = two_ranks(config, tmp_path / "run", *FSDP, *url)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from s3://{s3_bucket}/run/step_4 at step 4" in second.stderr
    losses = [(r["step"], r["loss"]) for r in records(tmp_path / "run")]
    assert losses == [(r["step"], r["loss"]) for r in records(tmp_path / "ref")]
    assert len(losses) == 6


# (mutant, the key refused, its words): each guard of a multi-rank run made inert
INERT = [
    ("replicas", "distributed.dp_replicate", "the layout has 2 replicas"),
    ("health", "resilience.health_timeout_s", "the control word has no group of its own"),
    ("stragglers", "resilience.straggler_ratio", "the step does not report its own time"),
    ("stacks", "distributed.timeout_s", "the hang watchdog writes no stacks"),
]


@pytest.mark.parametrize("mutant,key,words", INERT, ids=[m[0] for m in INERT])
def test_a_guard_made_inert_at_two_ranks_is_refused_at_start(
    tmp_path, small_corpus, mutant, key, words
):
    """The guard check reads each mechanism off the built run: made inert
    (``tests/distributed/inert_guard.py``), the start is refused by name on every rank
    before anything is written."""
    config = write_config(tmp_path, small_corpus)
    replicas = ["--distributed.dp_replicate=2", "--distributed.dp_shard=1"]
    argv = [str(REPO / "tests" / "distributed" / "inert_guard.py"), mutant, str(config),
            f"--run.dir={tmp_path / 'run'}", *COMMON, *replicas]  # fmt: skip
    out = run_ranks(2, argv, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert errors and all(e.startswith(f"error: {key}: {words}") for e in errors), errors
    assert not (tmp_path / "run" / "config.toml").exists()


def test_an_operation_without_a_deterministic_kernel_on_one_stage_refuses_replays_on_both(
    tmp_path, small_corpus
):
    """The kernel probe runs each rank's first computation through the pipeline (``pp=2``);
    the ranks agree: both name the operation and the rank that runs it, and neither waits
    for the other or writes anything."""
    config = write_config(tmp_path, small_corpus)
    argv = [str(REPO / "tests" / "distributed" / "inert_guard.py"), "kernels", str(config),
            f"--run.dir={tmp_path / 'run'}", *COMMON, "--distributed.pp=2",
            "--train.grad_accum_steps=2"]  # fmt: skip
    out = run_ranks(2, argv, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    key = "error: resilience.replay_first_step: replays compare a step's computations bit for bit"
    assert len(errors) == 2 and len(set(errors)) == 1, errors
    assert errors[0].startswith(key) and "the step runs put_ (on rank 1) without" in errors[0]
    assert not (tmp_path / "run" / "config.toml").exists()


def test_a_guard_refused_on_one_rank_is_refused_on_every_rank_at_once(tmp_path, small_corpus):
    """Rank 1 alone cannot act on a shutdown signal: both ranks refuse with its line, naming
    rank 1, instead of rank 0 claiming the run directory and waiting for a peer gone."""
    config = write_config(tmp_path, small_corpus)
    argv = [str(REPO / "tests" / "distributed" / "inert_guard.py"), "signals_on_one",
            str(config), f"--run.dir={tmp_path / 'run'}", *COMMON]  # fmt: skip
    out = run_ranks(2, argv, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 2 and len(set(errors)) == 1, errors
    assert errors[0].startswith("error: resilience.shutdown_timeout_s: SIGTERM, SIGUSR1 or SIGINT")
    assert errors[0].endswith("(on rank 1)"), errors
    assert not (tmp_path / "run").exists()


def test_a_probed_pipeline_start_trains_as_an_unprobed_one(tmp_path, small_corpus):
    """The probe's computation through both stages leaves nothing behind: each step's loss
    and grad norm equal a start without it (replays every 2 steps, the first not replayed)."""
    config = write_config(tmp_path, small_corpus)
    args = ["--distributed.pp=2", "--train.grad_accum_steps=2", "--train.max_steps=3",
            "--resilience.replay_interval=2", "--resilience.replay_first_step=false"]  # fmt: skip
    plain, _ = two_ranks(config, tmp_path / "plain", *args)
    assert plain.returncode == 0, plain.stderr[-3000:]
    argv = [str(REPO / "tests" / "distributed" / "inert_guard.py"), "probe", str(config),
            f"--run.dir={tmp_path / 'probed'}", *COMMON, *args]  # fmt: skip
    probed = run_ranks(2, argv, timeout=120)
    assert probed.returncode == 0, probed.stderr[-3000:]
    steps = [[(r["step"], r["loss"], r["grad_norm"]) for r in records(tmp_path / name)]
             for name in ("plain", "probed")]  # fmt: skip
    assert steps[0] == steps[1] and len(steps[0]) == 3


def test_the_guards_of_an_intact_two_rank_run_are_armed(tmp_path, small_corpus):
    config = write_config(tmp_path, small_corpus)
    replicas = ["--distributed.dp_replicate=2", "--distributed.dp_shard=1"]
    intact, _ = two_ranks(
        config, tmp_path / "run", *replicas, "--train.max_steps=2", "--scheduler.warmup_steps=1"
    )
    assert intact.returncode == 0, intact.stderr[-3000:]
    line = [x for x in intact.stderr.splitlines() if x.startswith("[forge] guards: ")]
    assert len(line) == 1, intact.stderr[-3000:]
    for words in ("replay first step (2 replicas)", "stragglers(1.5x)", "health(30 s)"):
        assert words in line[0], line
