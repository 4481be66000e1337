"""How long one save blocks the training loop, sync vs async, and how long a resume takes.

For the debug model and a ~100M-parameter model (fp32 weights + AdamW state), one process:
prints the sync save time; for each async mode, the time ``save()`` blocks the loop (staging a
copy) as a ratio of the sync time, for the first save (staging buffers allocated, checkpoint
process started) and for a later one (buffers reused), and the time until that save is
committed; what the integrity work adds to a sync save (the checksums of every file, computed
while DCP writes the shards, the finiteness check of the weights; target: at most 5%) against a
plain DCP save of the same state measured in the same run, beside what reading the files back
to checksum them would cost; the time a resume spends verifying the checksums; and the resume
load time. Then the storage axis: the same saves and resume of the debug model on the local
disk and in S3 (moto's server, started here on 127.0.0.1), as ratios::

    python benchmarks/checkpoint.py [--skip-large] [--storage-only]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from forge.checkpoint.checkpointer import Checkpointer, nonfinite_parameter
from forge.checkpoint.checksum_writer import ChecksummingWriter, hashing_pool
from forge.checkpoint.integrity import checksums_of, verify_checkpoint
from forge.checkpoint.object_path import ObjectPath
from forge.checkpoint.paths import CheckpointPath, location
from forge.checkpoint.store import STATE_DICT_OPTIONS, load_checkpoint, step_dir
from forge.cli import summary
from forge.config import ModelConfig, OptimizerConfig
from forge.config.sections import AsyncMode
from forge.model.transformer import Transformer, num_parameters
from forge.optim import build_optimizer

MODELS = {
    "debug": ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256),
    "100M": ModelConfig(dim=768, n_layers=12, n_heads=12, max_seq_len=256, vocab_size=32000),
}


def trained(cfg: ModelConfig) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = build_optimizer(model, OptimizerConfig())
    model(torch.randint(0, cfg.vocab_size, (1, 16))).float().mean().backward()
    opt.step()  # AdamW state exists, as in a real save
    opt.zero_grad()
    return model, opt


def hashed_save(state: dict, folder: pathlib.Path, pool: ThreadPoolExecutor) -> None:
    """A DCP save whose shards are checksummed while written, and the wait for the sums."""
    writer = ChecksummingWriter(folder, pool)
    dcp_save(state, checkpoint_id=str(folder), storage_writer=writer)
    writer.checksums()


def seconds(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def measure(name: str, cfg: ModelConfig, root: pathlib.Path) -> None:
    model, opt = trained(cfg)
    sync = Checkpointer(root / "sync", AsyncMode.DISABLED, 0, 1)
    model_sd, optim_sd = get_state_dict(model, opt, options=STATE_DICT_OPTIONS)
    state = {"model": model_sd, "optimizer": optim_sd}
    # alternate, so that both see the same page cache and disk state
    plain, hashed, forge = [], [], []
    pool = hashing_pool()
    for step in (1, 2, 3):  # alternated, the fastest of three each: the least disturbed
        plain.append(seconds(partial(dcp_save, state, checkpoint_id=str(root / f"plain{step}"))))
        hashed.append(seconds(partial(hashed_save, state, root / f"hashed{step}", pool)))
        forge.append(seconds(partial(sync.save, step, model, opt, {"step": step})))
    pool.shutdown()
    plain_s, hashed_s, sync_s = min(plain), min(hashed), min(forge)
    lines = []
    for mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_PROCESS):
        background = Checkpointer(root / mode.value, mode, 0, 1)
        blocked = []
        for step in (1, 2):
            start = time.perf_counter()
            background.save(step, model, opt, {"step": step})
            blocked.append(time.perf_counter() - start)
            background.wait()
            committed_s = time.perf_counter() - start
        background.close()
        lines.append(
            f"  {mode.value:>13}: first save blocks {blocked[0]:.3f} s "
            f"(ratio {blocked[0] / sync_s:.3f}), later saves {blocked[1]:.3f} s "
            f"(ratio {blocked[1] / sync_s:.3f}), committed after {committed_s:.3f} s"
        )
    saved = step_dir(root / "sync", 3)
    files = [p.name for p in saved.iterdir() if p.is_file()]
    start = time.perf_counter()
    checksums_of(saved, files)  # a read-back: what the commit computed before
    readback_s = time.perf_counter() - start
    start = time.perf_counter()
    nonfinite_parameter(model)
    finite_s = time.perf_counter() - start
    start = time.perf_counter()
    verify_checkpoint(saved)
    verify_s = time.perf_counter() - start
    fresh, fresh_opt = trained(cfg)
    start = time.perf_counter()
    load_checkpoint(saved, fresh, fresh_opt)  # verifies the checksums too
    load_s = time.perf_counter() - start
    size_mb = sum((saved / f).stat().st_size for f in files) / 1e6
    added = hashed_s - plain_s
    print(
        f"{name} ({num_parameters(model) / 1e6:.1f}M params, {size_mb:.0f} MB): sync save "
        f"{sync_s:.3f} s; DCP's write {plain_s:.3f} s plain, {hashed_s:.3f} s checksumming "
        f"the shards as written: +{added:.4f} s (ratio {added / plain_s:.3f}; reading the "
        f"files back to checksum them: {readback_s:.4f} s, ratio {readback_s / plain_s:.3f}); "
        f"the finiteness check {finite_s:.4f} s (ratio {finite_s / sync_s:.3f}); resume load "
        f"{load_s:.3f} s, of which verifying {verify_s:.4f} s (ratio {verify_s / load_s:.3f})"
    )
    print("\n".join(lines))


@contextlib.contextmanager
def local_s3() -> Iterator[str]:
    """moto's S3 server on a free local port, the AWS variables pointing at it; a bucket."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            time.sleep(0.05)
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
        )
        root = location("s3://forge-bench/checkpoints")
        assert isinstance(root, ObjectPath)
        root.fs.mkdir("forge-bench")
        yield str(root)
    finally:
        server.terminate()
        server.wait()


def costs(cfg: ModelConfig, root: CheckpointPath) -> list[float]:
    """[sync save, async save's block of the loop (a later save), its commit, resume load]
    in seconds, the fastest of three saves each."""
    model, opt = trained(cfg)
    sync = Checkpointer(root, AsyncMode.DISABLED, 0, 1)
    saved = [seconds(partial(sync.save, step, model, opt, {"step": step})) for step in (1, 2, 3)]
    sync.close()
    background = Checkpointer(root, AsyncMode.ASYNC, 0, 1)
    blocked, committed = [], []
    for step in (4, 5, 6):
        start = time.perf_counter()
        background.save(step, model, opt, {"step": step})
        blocked.append(time.perf_counter() - start)
        background.wait()
        committed.append(time.perf_counter() - start)
    background.close()
    fresh, fresh_opt = trained(cfg)
    load = seconds(partial(load_checkpoint, step_dir(root, 3), fresh, fresh_opt))
    return [min(saved), min(blocked[1:]), min(committed[1:]), load]


def measure_storage(name: str, cfg: ModelConfig, root: pathlib.Path) -> None:
    """The same saves and resume on the local disk and in S3 (moto's server on this machine:
    the cost of the object-store path, not of a network), local first, as ratios."""
    with local_s3() as url:
        local = costs(cfg, root / "local")
        remote = costs(cfg, location(url))
    what = ["sync save", "async save blocks the loop", "async save committed", "resume load"]
    print(f"{name}, S3 (moto, 127.0.0.1) against the local disk:")
    for label, here, there in zip(what, local, remote, strict=True):
        print(f"  {label:>26}: local {here:.3f} s, S3 {there:.3f} s, ratio {there / here:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument(
        "--storage-only", action="store_true", help="only the local-disk against S3 figures"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in MODELS.items():
            if name == "100M" and args.skip_large:
                continue
            if not args.storage_only:
                measure(name, cfg, pathlib.Path(tmp) / name)
        measure_storage("debug", MODELS["debug"], pathlib.Path(tmp) / "storage")


if __name__ == "__main__":
    main()
