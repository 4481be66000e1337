"""Checkpoints in an object store (``checkpoint.dir = "s3://..."``) against a real S3
endpoint (moto's server on 127.0.0.1, driven through s3fs): a resume is the uninterrupted local
run bit for bit, in every async mode; damage is named and the run falls back; retention,
the prefix's owner, and the scripts that read checkpoints all go through the URL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from forge.checkpoint.integrity import CHECKSUMS
from forge.checkpoint.paths import location
from forge.checkpoint.resume import ResumeSource, resolve_resume
from tests.conftest import REPO
from tests.e2e.test_train_script import TRAIN, load_script, losses, reference_config, run_dir
from tests.launched import launch
from tests.object_store import s3
from tests.zygote import run_script

CONVERT = load_script("convert_checkpoint")
EVAL = load_script("eval")
GENERATE = load_script("generate")
SAME_LR = "--scheduler.decay_steps=10"  # the schedule must not depend on where a run stops


def remote(bucket: str, *extra: str) -> list[str]:
    return [f"--checkpoint.dir=s3://{bucket}/run", "--checkpoint.interval=2", SAME_LR, *extra]


def objects(endpoint: str, bucket: str) -> list[str]:
    prefix = f"{bucket}/run/"
    return sorted(p.removeprefix(prefix) for p in s3(endpoint).find(prefix))


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory, small_corpus):
    """The uninterrupted run of 10 steps, its checkpoints on the local disk (once: every
    test compares with it)."""
    from tests.conftest import TINY

    reference = tmp_path_factory.mktemp("local_reference") / "tiny.toml"
    run = reference.parent / "run"
    reference.write_text(TINY.format(data=small_corpus) + f'\n[run]\ndir = "{run}"\n')
    assert TRAIN.main([str(reference), "--train.max_steps=10", SAME_LR]) == 0
    return reference


MODES = ["disabled", "async", "async_process"]


@pytest.mark.parametrize("mode", MODES)
def test_a_resume_from_s3_is_the_uninterrupted_local_run(
    tiny_config, local_reference, s3_bucket, s3_endpoint, mode
):
    args = remote(s3_bucket, f"--checkpoint.async_mode={mode}")
    assert TRAIN.main([str(tiny_config), "--train.max_steps=6", *args]) == 0
    assert objects(s3_endpoint, s3_bucket)[:2] == ["latest", "owner.json"]
    assert s3(s3_endpoint).cat(f"{s3_bucket}/run/latest") == b"step_6"
    assert TRAIN.main([str(tiny_config), "--train.max_steps=10", *args]) == 0
    assert losses(tiny_config) == losses(local_reference)  # exact floats, steps 1-10
    assert not (run_dir(tiny_config) / "checkpoints").exists()  # nothing local
    records = [json.loads(line) for line in (run_dir(tiny_config) / "metrics.jsonl").open()]
    costs = {r["step"]: r for r in records if "checkpoint/bytes" in r}
    assert costs and all(r["checkpoint/bytes"] > 0 for r in costs.values())
    (resume,) = [r for r in records if "checkpoint/load_s" in r]  # what the resume cost
    assert resume["step"] == 7 and resume["checkpoint/verify_s"] > 0


def test_a_flipped_byte_in_the_newest_checkpoint_falls_back_naming_it(
    tiny_config, local_reference, s3_bucket, s3_endpoint, capsys
):
    assert TRAIN.main([str(tiny_config), "--train.max_steps=6", *remote(s3_bucket)]) == 0
    fs = s3(s3_endpoint)
    shards = {p: fs.size(p) for p in fs.find(f"{s3_bucket}/run/step_6")}
    largest = max(shards, key=shards.__getitem__)
    data = bytearray(fs.cat(largest))
    data[len(data) // 3] ^= 0x01
    fs.pipe(largest, bytes(data))
    capsys.readouterr()
    assert TRAIN.main([str(tiny_config), "--train.max_steps=10", *remote(s3_bucket)]) == 0
    err = capsys.readouterr().err
    assert f"step_6/{largest.rsplit('/', 1)[-1]}: checksum mismatch" in err
    assert f"resumed from s3://{s3_bucket}/run/step_4 at step 4" in err
    assert losses(tiny_config) == losses(local_reference)


def test_retention_keeps_the_last_n_in_the_store(tiny_config, s3_bucket, s3_endpoint):
    args = remote(s3_bucket, "--checkpoint.keep_last_n=2")
    assert TRAIN.main([str(tiny_config), "--train.max_steps=10", *args]) == 0
    steps = {o.split("/")[0] for o in objects(s3_endpoint, s3_bucket) if o.startswith("step_")}
    assert steps == {"step_8", "step_10"}


def test_eval_reads_the_checkpoint_from_the_url(tiny_config, s3_bucket, capsys):
    assert TRAIN.main([str(tiny_config), "--train.max_steps=4", *remote(s3_bucket)]) == 0
    capsys.readouterr()
    assert EVAL.main([str(run_dir(tiny_config)), "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["checkpoint"] == f"s3://{s3_bucket}/run/step_4"


def test_generate_and_export_read_the_checkpoint_from_the_url(
    tiny_config, tmp_path, s3_bucket, capsys
):
    assert TRAIN.main([str(tiny_config), "--train.max_steps=4", *remote(s3_bucket)]) == 0
    out = tmp_path / "export"
    capsys.readouterr()
    assert CONVERT.main(["export", str(run_dir(tiny_config)), "--out", str(out)]) == 0
    assert f"s3://{s3_bucket}/run/step_4" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file()
    prompt = ["--prompt", "def ", "--max-new-tokens", "4", "--seed", "1"]
    assert GENERATE.main([str(run_dir(tiny_config)), *prompt]) == 0


def test_a_second_run_directory_cannot_write_to_the_same_prefix(
    tiny_config, tmp_path, s3_bucket, s3_endpoint, capsys
):
    assert TRAIN.main([str(tiny_config), "--train.max_steps=4", *remote(s3_bucket)]) == 0
    before = objects(s3_endpoint, s3_bucket)
    other = tmp_path / "other"
    capsys.readouterr()
    code = TRAIN.main([str(tiny_config), f"--run.dir={other}", *remote(s3_bucket)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: checkpoint.dir:")
    assert f"another run (run.dir {run_dir(tiny_config)}" in err[-1]
    assert not other.exists() and objects(s3_endpoint, s3_bucket) == before
    # the owner itself resumes, from any process
    assert TRAIN.main([str(tiny_config), "--train.max_steps=6", *remote(s3_bucket)]) == 0


def test_a_run_refused_after_claiming_a_new_prefix_leaves_nothing_behind(
    tiny_config, s3_bucket, s3_endpoint, capsys
):
    empty = f"--checkpoint.load_path=s3://{s3_bucket}/nothing"
    capsys.readouterr()
    assert TRAIN.main([str(tiny_config), *remote(s3_bucket), empty]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "no complete checkpoint there" in err[-1]
    assert objects(s3_endpoint, s3_bucket) == [] and not run_dir(tiny_config).exists()


# (case, the URL, a fragment of the one-line refusal)
BAD_URLS = [
    ("a bucket that does not exist", "s3://forge-no-such-bucket/run", "the bucket 'forge-no-such-bucket' does not exist"),
    ("an unknown protocol", "nosuch://bucket/run", "'nosuch://' is not a storage protocol"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("url", "message"), [c[1:] for c in BAD_URLS], ids=[c[0] for c in BAD_URLS]
)
def test_a_url_the_run_cannot_use_is_refused_in_one_line(
    tiny_config, s3_bucket, capsys, url, message
):
    capsys.readouterr()
    assert TRAIN.main([str(tiny_config), f"--checkpoint.dir={url}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: checkpoint.dir") and message in err[-1], err
    assert not run_dir(tiny_config).exists()


def killed_during_an_upload(fs, bucket: str, argv: list[str]) -> str | None:
    """Run ``train.py argv`` and SIGKILL it as soon as a checkpoint after the first has some
    objects but no marker; that checkpoint's folder name (None: the run ended first)."""
    proc = launch([str(REPO / "scripts" / "train.py"), *argv])
    partial, deadline = None, time.monotonic() + 120
    try:
        while "step 1 |" not in proc.stdout() and proc.poll() is None:  # no save before it
            assert time.monotonic() < deadline, proc.stderr()
            time.sleep(0.01)
        while partial is None and proc.poll() is None and time.monotonic() < deadline:
            found: dict[str, set[str]] = {}  # step folder -> its objects so far
            for name in fs.find(f"{bucket}/run/"):
                parts = name.split("/")
                if len(parts) == 4 and parts[2].startswith("step_"):
                    found.setdefault(parts[2], set()).add(parts[3])
            partial = next(
                (s for s, f in found.items() if CHECKSUMS not in f and s != "step_1"), None
            )
    finally:
        proc.kill()
    return partial


def test_a_save_killed_during_its_upload_is_invisible_and_the_next_run_resumes_before_it(
    tiny_config, tmp_path, s3_bucket, s3_endpoint
):
    """SIGKILL while a checkpoint's objects are being uploaded (some there, no marker): no
    reader sees that checkpoint, and the next run resumes from the one before, exactly."""
    big = ["--model.dim=128", "--model.n_layers=4", "--model.n_heads=8", "--model.n_kv_heads=4"]
    args = [*big, *remote(s3_bucket, "--checkpoint.interval=1"), "--train.max_steps=10"]
    reference = reference_config(tiny_config, tmp_path)
    assert TRAIN.main([str(reference), *big, "--train.max_steps=10", SAME_LR]) == 0
    fs = s3(s3_endpoint)
    for _ in range(3):  # a save may commit between the listing and the kill: then again
        partial = killed_during_an_upload(fs, s3_bucket, [str(tiny_config), *args])
        if partial is not None and not fs.exists(f"{s3_bucket}/run/{partial}/{CHECKSUMS}"):
            break
        fs.rm(f"{s3_bucket}/run", recursive=True)
        shutil.rmtree(run_dir(tiny_config), ignore_errors=True)
    else:
        pytest.fail("no upload in progress was caught in three runs")
    root = location(f"s3://{s3_bucket}/run")
    plan = resolve_resume(root, None)
    assert plan.source is ResumeSource.CHECKPOINT_DIR and plan.path is not None
    assert int(plan.path.name.removeprefix("step_")) < int(partial.removeprefix("step_"))
    assert all(p.name != partial for p in (*plan.fallbacks, *plan.skipped))
    assert TRAIN.main([str(tiny_config), *args]) == 0
    assert losses(tiny_config)[-10:] == losses(reference)


@pytest.fixture(scope="module")
def guarded():
    from tests.object_store import guarded_store

    with guarded_store() as store:
        yield store


NO_CREDENTIALS = {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}
NO_CREDENTIALS |= {"AWS_EC2_METADATA_DISABLED": "true"}

# (case, the credentials: a key and secret, None for the reader's, {} for none at all, a
# fragment of the one-line refusal)
REFUSED_CREDENTIALS = [
    ("unknown credentials", ("nobody", "nothing"), "access denied (PermissionError: The AWS Access Key Id you provided does not exist"),
    ("a user who may only read", None, "cannot write to s3://forge-guarded/run (PermissionError: Access Denied): a read-only prefix?"),
    ("no credentials at all", {}, "the store cannot be used (NoCredentialsError: Unable to locate credentials)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("credentials", "message"),
    [c[1:] for c in REFUSED_CREDENTIALS],
    ids=[c[0] for c in REFUSED_CREDENTIALS],
)
def test_credentials_the_store_refuses_are_one_line_and_nothing_is_written(
    tiny_config, guarded, credentials, message
):
    """In a process of its own: the endpoint and credentials come from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"AWS_ENDPOINT_URL": guarded["endpoint"], "AWS_DEFAULT_REGION": "us-east-1"}
    if credentials == {}:
        env |= NO_CREDENTIALS
    else:
        key, secret = credentials or (guarded["key"], guarded["secret"])
        env |= {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    url = f"--checkpoint.dir=s3://{guarded['bucket']}/run"
    done = run_script([str(REPO / "scripts" / "train.py"), str(tiny_config), url], env=env)
    stderr = done.stderr.decode()
    err = stderr.strip().splitlines()
    assert done.returncode == 2 and err[-1].startswith("error: checkpoint.dir:"), stderr
    assert message in err[-1] and "Traceback" not in stderr
    assert not run_dir(tiny_config).exists()
    import s3fs

    reader = s3fs.S3FileSystem(
        endpoint_url=guarded["endpoint"], key=guarded["key"], secret=guarded["secret"]
    )
    assert reader.ls(guarded["bucket"], refresh=True) == []  # nothing in the store either


def test_a_url_as_load_path_gives_a_new_run_its_initial_weights(
    tiny_config, tmp_path, s3_bucket, capsys
):
    assert TRAIN.main([str(tiny_config), "--train.max_steps=4", *remote(s3_bucket)]) == 0
    capsys.readouterr()
    load = f"--checkpoint.load_path=s3://{s3_bucket}/run/step_4"
    assert TRAIN.main([str(tiny_config), f"--run.dir={tmp_path / 'new'}", load]) == 0
    assert f"initial weights from s3://{s3_bucket}/run/step_4" in capsys.readouterr().err


def test_a_store_that_stops_answering_during_a_save_ends_the_run_by_name_and_it_resumes_exactly(
    tiny_config, local_reference, monkeypatch
):
    """The store stops answering (its server SIGSTOPped) while a save uploads: the loop,
    waiting for that save before the next, asks the store and names it within two
    ``checkpoint.storage_timeout_s``; the upload cannot be stopped, so the run ends (exit 5)
    rather than wait for ever or go on beside it. Relaunched once the store answers, it
    resumes from the last commit and is the uninterrupted run bit for bit."""
    from tests.object_store import ENV, moto_process, new_bucket

    with moto_process() as (endpoint, server):  # its own server: this test stops it
        for name, value in {**ENV, "AWS_ENDPOINT_URL": endpoint}.items():
            monkeypatch.setenv(name, value)
        bucket = new_bucket(endpoint)
        argv = [str(tiny_config), "--train.max_steps=10", "--checkpoint.storage_timeout_s=3",  # its set-up too, on a loaded machine
                *remote(bucket, "--checkpoint.async_mode=async")]  # fmt: skip
        env = {**os.environ, "FORGE_FAULTS": "slow:step=1:seconds=0.3"}
        proc = launch([str(REPO / "scripts" / "train.py"), *argv], env)
        stopped, code, err = False, None, ""
        try:
            metrics = run_dir(tiny_config) / "metrics.jsonl"
            while not stopped and proc.poll() is None:
                if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                    server.send_signal(signal.SIGSTOP)  # as a save is about to start
                    stopped = True
                time.sleep(0.02)
            # a loop that waits on the store for ever fails here (killed at 60 s)
            code, _, err = proc.finish(timeout=60)
        finally:
            proc.kill()
            server.send_signal(signal.SIGCONT)
        assert stopped and code == 5, err
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: checkpoint.dir s3://{bucket}/run: saving step "), err
        assert "did not answer within checkpoint.storage_timeout_s=3 s" in last
        assert "for a store that is slow to answer)" in last  # the whole line, not cut
        assert last.endswith("so the run ends: relaunch it once the store answers (it "
                             "resumes from the last committed checkpoint)")  # fmt: skip
        assert "Traceback" not in err
        # the store answers again (a process of its own: fsspec keeps, per process, the file
        # system of the first endpoint it was given, this worker's shared server's)
        again = run_script([str(REPO / "scripts" / "train.py"), *argv], timeout=120)
        assert again.returncode == 0, again.stderr.decode()[-3000:]
        assert losses(tiny_config) == losses(local_reference)  # exact floats, steps 1-10
        assert s3(endpoint).cat(f"{bucket}/run/latest") == b"step_10"
