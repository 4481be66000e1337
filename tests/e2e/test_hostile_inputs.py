"""Bad input of every kind, given as a hostile user would: each row runs ``scripts/train.py``
as a real process and asserts its exit code, exactly one ``error:`` line naming the culprit,
no traceback, and what is on disk afterwards. Most rows fail before any training step."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable

import numpy as np
import pytest

from forge.checkpoint.resume import ResumeSource, resolve_resume
from tests.e2e.sandbox import Result, Run, copy_trained, train_here

# --- setups: each breaks one thing in the sandbox (some take the trained run) and returns
# the extra command-line arguments


def nothing(run: Run) -> list[str]:
    return []


def args(*extra: str) -> Callable[[Run], list[str]]:
    return lambda run: list(extra)


def config_is_a_directory(run: Run) -> list[str]:
    run.config.unlink()
    run.config.mkdir()
    return []


def config_not_utf8(run: Run) -> list[str]:
    run.config.write_bytes(run.config.read_bytes() + "\n# caf\xe9\n".encode("latin-1"))
    return []


def config_missing(run: Run) -> list[str]:
    run.config.unlink()
    return []


def config_invalid_toml(run: Run) -> list[str]:
    run.config.write_text(run.config.read_text() + "\n[train\n")
    return []


def run_dir_is_a_file(run: Run) -> list[str]:
    run.dir.write_text("not a folder")
    return []


def run_dir_below_a_file(run: Run) -> list[str]:
    (run.root / "file").write_text("x")
    return [f"--run.dir={run.root / 'file' / 'run'}"]


def checkpoint_dir_is_a_file(run: Run) -> list[str]:
    (run.root / "ckfile").write_text("x")
    return [f"--checkpoint.dir={run.root / 'ckfile'}"]


def manifest(run: Run) -> dict:
    return json.loads((run.data / "manifest.json").read_text())


def write_manifest(run: Run, raw: dict) -> None:
    (run.data / "manifest.json").write_text(json.dumps(raw))


def manifest_missing(run: Run) -> list[str]:
    (run.data / "manifest.json").unlink()
    return []


def manifest_not_json(run: Run) -> list[str]:
    (run.data / "manifest.json").write_text("{not json")
    return []


def manifest_float_dtype(run: Run) -> list[str]:
    write_manifest(run, {**manifest(run), "dtype": "float32"})
    return ["--data.verify_checksum=false"]


def manifest_from_a_newer_forge(run: Run) -> list[str]:
    write_manifest(run, {**manifest(run), "format_version": 99})
    return []


def shard_odd_bytes(run: Run) -> list[str]:
    shard = run.data / manifest(run)["splits"]["train"]["shards"][0]["file"]
    with shard.open("ab") as f:
        f.write(b"\x01")
    return ["--data.verify_checksum=false"]


def shard_missing(run: Run) -> list[str]:
    (run.data / manifest(run)["splits"]["train"]["shards"][0]["file"]).unlink()
    return []


def shard_corrupt(run: Run) -> list[str]:
    shard = run.data / manifest(run)["splits"]["train"]["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[100:104] = b"\x00\x01\x00\x01"
    shard.write_bytes(bytes(data))
    return []


def shard_out_of_vocab(verify: bool) -> Callable[[Run], list[str]]:
    """A shard holding an id past the vocabulary (another tokenizer's), its checksum
    recorded, so that only the id check can catch it."""

    def setup(run: Run) -> list[str]:
        raw = manifest(run)
        entry = raw["splits"]["train"]["shards"][0]
        shard = run.data / entry["file"]
        tokens = np.fromfile(shard, dtype=raw["dtype"])
        tokens[77] = 300  # the byte tokenizer's vocab is 259
        tokens.tofile(shard)
        entry["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
        write_manifest(run, raw)
        return [f"--data.verify_checksum={str(verify).lower()}"]

    return setup


def run_dir_with_a_nul_byte(run: Run) -> list[str]:
    text = run.config.read_text().replace('dir = "', 'dir = "\\u0000')
    run.config.write_text(text)
    return []


def empty_validation_split(run: Run) -> list[str]:
    raw = manifest(run)
    for shard in raw["splits"]["validation"]["shards"]:
        (run.data / shard["file"]).unlink()
    raw["splits"]["validation"] = {"shards": [], "num_tokens": 0, "num_documents": 0}
    write_manifest(run, raw)
    return ["--eval.interval=5"]


def load_path_missing(run: Run) -> list[str]:
    return [f"--checkpoint.load_path={run.root / 'nowhere'}"]


def resume_with(*extra: str) -> Callable[[Run, Run], list[str]]:
    def setup(run: Run, trained: Run) -> list[str]:
        copy_trained(trained, run)
        return ["--train.max_steps=12", *extra]

    return setup


def poisoned_metadata(run: Run, trained: Run) -> list[str]:
    from tests.integration.test_checkpoint_security import Payload

    copy_trained(trained, run)
    for step in ("step_5", "step_10"):
        (run.ckpt / step / ".metadata").write_bytes(pickle.dumps(Payload(run.root / "pwned")))
    return ["--train.max_steps=12"]


def every_checkpoint_truncated(run: Run, trained: Run) -> list[str]:
    copy_trained(trained, run)
    for step in ("step_5", "step_10"):
        (run.ckpt / step / "__0_0.distcp").write_bytes(b"")
    return ["--train.max_steps=12"]


def another_runs_records(run: Run, trained: Run) -> list[str]:
    copy_trained(trained, run)
    return [f"--checkpoint.dir={run.root / 'elsewhere'}", "--train.max_steps=12"]


def ledger_replaced_by(kind: str) -> Callable[[Run, Run], list[str]]:
    """The trained run's goodput.jsonl replaced by a FIFO (a launch opening it would wait for
    a reader for good) or a folder."""

    def setup(run: Run, trained: Run) -> list[str]:
        copy_trained(trained, run)
        ledger = run.dir / "goodput.jsonl"
        ledger.unlink()
        if kind == "fifo":
            os.mkfifo(ledger)
        else:
            ledger.mkdir()
        return ["--train.max_steps=12"]

    return setup


def another_model_before_its_first_checkpoint(run: Run, trained: Run) -> list[str]:
    copy_trained(trained, run)
    shutil.rmtree(run.ckpt)  # a run that crashed before its first checkpoint...
    (run.dir / "checkpoints.jsonl").unlink()  # ...so it recorded no commit...
    return ["--model.dim=64"]  # ...restarted as another model


# --- what must hold on disk afterwards


def no_run_dir(run: Run) -> None:
    assert not run.dir.exists() or not any(run.dir.iterdir()), list(run.dir.iterdir())


def no_new_dirs(run: Run) -> None:
    assert not (run.root / "file" / "run").exists() and not (run.root / "elsewhere").exists()


def checkpoints_intact(run: Run) -> None:
    plan = resolve_resume(run.ckpt, None)
    assert plan.source is ResumeSource.CHECKPOINT_DIR and plan.path == run.ckpt / "step_10"
    assert os.readlink(run.ckpt / "latest") == "step_10"
    assert not list(run.ckpt.glob("*.tmp"))
    lines = (run.dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 11))  # not trimmed


def nothing_executed(run: Run) -> None:
    assert not (run.root / "pwned").exists()
    checkpoints_intact(run)


# (case, setup, exit code, text the one error line holds, check on disk)
CONFIG_CASES = [
    ("unknown key", args("--train.max_step=5"), 2, "train.max_step: unknown key", no_run_dir),
    ("nan learning rate", args("--optimizer.lr=nan"), 2, "optimizer.lr: expected a finite", no_run_dir),
    ("inf learning rate", args("--optimizer.lr=inf"), 2, "optimizer.lr: expected a finite", no_run_dir),
    ("nan init std", args("--model.init_std=nan"), 2, "model.init_std", no_run_dir),
    ("nan rope theta", args("--model.rope_theta=nan"), 2, "model.rope_theta", no_run_dir),
    ("seed beyond 64 bits", args("--train.seed=99999999999999999999999"), 2, "train.seed: 99999999999999999999999 is out of range", no_run_dir),
    ("negative data seed", args("--train.data_seed=-7"), 2, "train.data_seed: must be >= 0, got -7", no_run_dir),
    ("wandb without credentials", args("--metrics.wandb=true"), 2, "metrics.wandb: no W&B credentials", no_run_dir),
    ("empty run dir", args("--run.dir="), 2, "run.dir: must not be empty", no_run_dir),
    ("float for an int", args("--checkpoint.interval=1e3"), 2, "checkpoint.interval: expected an integer, got 1000.0", no_run_dir),
    ("three betas", args("--optimizer.betas=[0.9,0.9,0.9]"), 2, "optimizer.betas: expected 2 values, got 3", no_run_dir),
    ("bad enum", args("--train.mixed_precision=fp16"), 2, "train.mixed_precision: expected one of", no_run_dir),
    ("boolean for an int", args("--model.dim=true"), 2, "model.dim: expected an integer, got a boolean", no_run_dir),
    ("run ends inside warmup", args("--train.max_steps=2"), 2, "scheduler.warmup_steps", no_run_dir),
    ("stray argument", args("oops"), 2, "'oops': unexpected argument", no_run_dir),
    ("config is a directory", config_is_a_directory, 2, "is a directory", no_run_dir),
    ("config not UTF-8", config_not_utf8, 2, "not UTF-8", no_run_dir),
    ("config missing", config_missing, 2, "config file not found", no_run_dir),
    ("config invalid TOML", config_invalid_toml, 2, "invalid TOML", no_run_dir),
    ("run dir is a file", run_dir_is_a_file, 2, "run.dir: ", lambda run: None),
    ("run dir below a file", run_dir_below_a_file, 2, "lies below the file", no_new_dirs),
    ("checkpoint dir is a file", checkpoint_dir_is_a_file, 2, "checkpoint.dir: ", no_run_dir),
    ("run dir cannot be created", args("--run.dir=/proc/forge-run"), 2, "run.dir: cannot create /proc/forge-run", no_run_dir),
    ("run dir name too long", lambda run: [f"--run.dir={run.root / ('a' * 300)}"], 2, "run.dir: the name 'aaaaaaaaaaaaaaaaaaaaaaaa...' is 300 bytes long", no_run_dir),
    ("run dir with a NUL byte", run_dir_with_a_nul_byte, 2, "run.dir: contains a NUL byte", no_run_dir),
    ("data path name too long", args("--data.path=/tmp/" + "d" * 256), 2, "data.path: the name", no_run_dir),
    ("load path name too long", args("--checkpoint.load_path=/tmp/" + "l" * 256), 2, "checkpoint.load_path: the name", no_run_dir),
    ("model too large to allocate", args("--model.dim=4194304"), 2, "model.dim: this run needs an estimated", no_run_dir),
    ("max seq len too large to allocate", args("--model.max_seq_len=4611686018427387904"), 2, "model.max_seq_len: this run needs an estimated", no_run_dir),
    ("micro-batch too large to allocate", args("--train.batch_size=1000000"), 2, "train.batch_size: this run needs an estimated", no_run_dir),
    ("context parallelism beyond the world", args("--distributed.cp=2"), 2, "distributed: pp*dp_replicate*dp_shard*cp*tp = 1*1*1*2*1 = 2, but the world size is 1", no_run_dir),
]  # fmt: skip

DATA_CASES = [
    ("manifest missing", manifest_missing, 2, "no dataset manifest", no_run_dir),
    ("manifest not JSON", manifest_not_json, 2, "malformed manifest", no_run_dir),
    ("manifest from a newer forge", manifest_from_a_newer_forge, 2, "format_version 99 is a newer forge's (this forge reads format_version 1)", no_run_dir),
    ("manifest dtype not a token dtype", manifest_float_dtype, 2, "dtype 'float32' is not a token dtype", no_run_dir),
    ("shard of an odd byte size", shard_odd_bytes, 2, "train_00000.bin: ", no_run_dir),
    ("shard missing", shard_missing, 2, "train_00000.bin: shard listed in the manifest is missing", no_run_dir),
    ("shard checksum", shard_corrupt, 2, "train_00000.bin: checksum mismatch", no_run_dir),
    ("shard with an id past the vocab", shard_out_of_vocab(verify=True), 2, "train_00000.bin: token 77 is id 300, outside the manifest's vocab_size 259", no_run_dir),
    ("shard with an id past the vocab, unverified", shard_out_of_vocab(verify=False), 2, "train_00000.bin: token 77 is id 300", no_run_dir),
    ("empty validation split", empty_validation_split, 2, "split 'validation' has 0 windows", no_run_dir),
    ("vocab smaller than the data's", args("--model.vocab_size=100"), 2, "model.vocab_size: 100 is smaller", no_run_dir),
    ("data path elsewhere", args("--data.path=/nonexistent"), 2, "data.path: /nonexistent/manifest.json", no_run_dir),
    ("load path missing", load_path_missing, 2, "checkpoint.load_path=", no_run_dir),
]  # fmt: skip

CHECKPOINT_CASES = [
    ("resume with another rope theta", resume_with("--model.rope_theta=500000"), 2, "model.rope_theta: 10000.0 → 500000.0", checkpoints_intact),
    ("resume with another norm eps", resume_with("--model.norm_eps=1e-6"), 2, "model.norm_eps", checkpoints_intact),
    ("resume with another max seq len", resume_with("--model.max_seq_len=64"), 2, "model.max_seq_len", checkpoints_intact),
    ("resume with another seq len", resume_with("--train.seq_len=16"), 2, "train.seq_len: 32 → 16", checkpoints_intact),
    ("resume with another seed", resume_with("--train.seed=4"), 2, "train.seed", checkpoints_intact),
    ("resume with another data seed", resume_with("--train.data_seed=9"), 2, "train.data_seed", checkpoints_intact),
    ("resume with another global batch", resume_with("--train.batch_size=2"), 2, "global batch", checkpoints_intact),
    ("resume with other data sources", resume_with("--data.temperature=2.0"), 2, "data.temperature", checkpoints_intact),
    ("resume on the other split", resume_with("--data.train_split=validation"), 2, "data.train_split: 'train' → 'validation'", checkpoints_intact),
    ("a pickle payload in the metadata", poisoned_metadata, 2, "refusing to load it", nothing_executed),
    ("no checkpoint loads", every_checkpoint_truncated, 2, "no checkpoint there loads", lambda run: None),
    ("a fresh start over another run's records", another_runs_records, 2, "run.dir: ", checkpoints_intact),
    ("another model over a crashed run's records", another_model_before_its_first_checkpoint, 2, "model.dim", lambda run: None),
    ("a FIFO for the goodput ledger", ledger_replaced_by("fifo"), 2, "goodput.jsonl is a FIFO, not a file", checkpoints_intact),
    ("a folder for the goodput ledger", ledger_replaced_by("folder"), 2, "goodput.jsonl is a folder, not a file", checkpoints_intact),
]  # fmt: skip


def check_row(run: Run, result: Result, code: int, culprit: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.code == code, result.stderr
    assert len(result.errors) == 1, result.stderr
    assert culprit in result.errors[0], result.errors


@pytest.mark.parametrize(
    "setup,code,culprit,after",
    [c[1:] for c in CONFIG_CASES + DATA_CASES],
    ids=[c[0] for c in CONFIG_CASES + DATA_CASES],
)
def test_bad_config_or_data_is_one_line_and_leaves_nothing(sandbox, setup, code, culprit, after):
    result = train_here(sandbox, *setup(sandbox))
    check_row(sandbox, result, code, culprit)
    after(sandbox)


@pytest.mark.parametrize(
    "setup,code,culprit,after",
    [c[1:] for c in CHECKPOINT_CASES],
    ids=[c[0] for c in CHECKPOINT_CASES],
)
def test_bad_checkpoint_or_run_dir_is_one_line_and_loses_nothing(
    sandbox, trained, setup, code, culprit, after
):
    result = train_here(sandbox, *setup(sandbox, trained))
    check_row(sandbox, result, code, culprit)
    after(sandbox)


def test_the_hostile_table_covers_every_class():
    assert len(CONFIG_CASES) + len(DATA_CASES) + len(CHECKPOINT_CASES) >= 35
