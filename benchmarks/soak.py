"""A fault soak: a real 2-rank torchrun job under faults of mixed kinds, relaunched as a
scheduler would until it completes, measured against the same job never interrupted.

Faults, drawn from ``--seed`` at random steps:

- process faults, sent by the soak to the running launch when its records reach the step:
  ``kill_rank`` (SIGKILL one rank), ``term_job`` (SIGTERM the job: torchrun's shutdown),
  ``stall_rank`` (SIGSTOP one rank past ``distributed.timeout_s``, then SIGCONT: its peer
  ends HEALTH_FAILURE; a fault a launch outlives counts as recovered in the job),
  ``kill_in_save`` (SIGKILL one rank as a checkpoint step's async save starts),
  ``store_stall`` (the checkpoint store stops answering: its server SIGSTOPped for
  ``STORE_STALL_S``, then SIGCONT; the job's checkpoints are then in an S3 bucket of moto's
  server, which the soak starts: the dev extra);
- in-job faults, keyed by step in ``FORGE_FAULTS`` (each launch that reaches the step meets
  them again, and so does the reference run): ``nan`` (skipped by policy), ``spike``
  (skipped by ``on_spike = "skip"``), ``corrupt`` (a flipped gradient bit on a replayed step,
  outvoted).

Reported: recovery success (the final checkpoint's every tensor bit-identical to the
uninterrupted run's, and every step's loss equal), time to recover per process fault (the
fault to the first step after it, with its parts: down until the next launch started, that
launch's imports, set-up, load and verification from its goodput ledger, and the steps
recomputed), the steps recomputed, and the run's goodput::

    python benchmarks/soak.py --faults 8 --seed 0 [--steps 60] [--data data/stdlib]
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import importlib.util
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import attrs

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: forge from this checkout

from forge.cli import summary  # noqa: E402
from forge.errors import print_errors  # noqa: E402
from forge.metrics.goodput import goodput, read_ledger, run_totals  # noqa: E402
from forge.outputs import (  # noqa: E402
    enclosing_dataset,
    enclosing_run,
    file_output_problem,
    replace_file,
)
from forge.training.loop.plan import SPIKE_WARMUP  # noqa: E402

INTERVAL = 5  # steps between checkpoints
LAUNCH_LIMIT = 300.0  # seconds a launch may take before the soak gives up on it
COLLECTIVE_TIMEOUT_S = 10  # distributed.timeout_s: a stalled rank outlasts it
STORAGE_TIMEOUT_S = 2  # checkpoint.storage_timeout_s with a store
STORE_STALL_S = 3 * STORAGE_TIMEOUT_S  # a stalled store outlasts the wait for a save


class Kind(enum.Enum):
    KILL_RANK = "kill_rank"
    TERM_JOB = "term_job"
    STALL_RANK = "stall_rank"
    KILL_IN_SAVE = "kill_in_save"
    NAN = "nan"
    SPIKE = "spike"
    CORRUPT = "corrupt"
    STORE_STALL = "store_stall"


# sent by the soak while a launch runs (the others are keyed by step in FORGE_FAULTS)
PROCESS = (Kind.KILL_RANK, Kind.TERM_JOB, Kind.STALL_RANK, Kind.KILL_IN_SAVE, Kind.STORE_STALL)
OUTLIVED = (Kind.STALL_RANK, Kind.STORE_STALL)  # a launch may go on through these


@attrs.frozen
class Store:
    """The S3 store the job's checkpoints go to (with ``store_stall``): moto's server."""

    endpoint: str
    bucket: str
    server: subprocess.Popen = attrs.field(eq=False)

    def env(self) -> dict[str, str]:
        from tests.object_store import ENV

        return {**ENV, "AWS_ENDPOINT_URL": self.endpoint}

    def args(self, prefix: str) -> list[str]:
        return [f"--checkpoint.dir=s3://{self.bucket}/{prefix}",
                f"--checkpoint.storage_timeout_s={STORAGE_TIMEOUT_S}"]  # fmt: skip


@attrs.frozen
class Fault:
    kind: Kind
    step: int  # sent once the records reach this step (process), or keyed to it (in-job)
    rank: int = 1


def plan_faults(seed: int, count: int, steps: int, kinds: Sequence[Kind]) -> list[Fault]:
    """``count`` faults of ``kinds`` in turn (shuffled by ``seed``), at steps drawn from it:
    in-job ones at distinct steps (a spike after the loss statistics' warm-up, a corruption
    on a replayed step), process ones anywhere before the last step (one at a save step for
    ``kill_in_save``), in step order."""
    rng = random.Random(seed)
    order = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(order)
    taken: set[int] = set()
    faults = []
    for kind in order:
        if kind is Kind.SPIKE:
            choices = range(12, steps)
        elif kind is Kind.CORRUPT:
            choices = range(INTERVAL, steps, INTERVAL)  # replay_interval = INTERVAL
        elif kind is Kind.KILL_IN_SAVE:
            choices = range(INTERVAL, steps, INTERVAL)
        else:
            choices = range(2, steps)
        free = [s for s in choices if kind in PROCESS or s not in taken]
        if not free:
            raise ValueError(
                f"--faults {count} --steps {steps}: no step left for a {kind.value} fault "
                f"(in-job faults take a step each; {kind.value} needs a step in "
                f"{choices.start}..{steps - 1}); raise --steps or lower --faults"
            )
        step = rng.choice(free)
        if kind not in PROCESS:
            taken.add(step)
        faults.append(Fault(kind, step, rank=rng.randrange(2)))
    return sorted(faults, key=lambda f: (f.step, f.kind.value))


def in_job_env(faults: Sequence[Fault]) -> str:
    """``FORGE_FAULTS`` for the in-job faults (every launch and the reference get it)."""
    entries = {
        Kind.NAN: "nan:step={step}",
        Kind.SPIKE: "spike:step={step}:scale=1000",
        Kind.CORRUPT: "corrupt:step={step}:rank={rank}",
    }
    return ",".join(
        entries[f.kind].format(step=f.step, rank=f.rank) for f in faults if f.kind in entries
    )


def config_args(data: pathlib.Path, steps: int) -> list[str]:
    """The soak's job: the debug config at dim 64, 2 layers, 64 tokens per row."""
    return [
        str(REPO / "configs" / "train" / "debug.toml"),
        f"--data.path={data}",
        "--model.dim=64",
        "--model.n_layers=2",
        "--model.max_seq_len=64",
        "--train.seq_len=64",
        f"--train.max_steps={steps}",
        "--scheduler.warmup_steps=2",
        "--distributed.dp_shard=2",
        f"--distributed.timeout_s={COLLECTIVE_TIMEOUT_S}",
        "--resilience.health_timeout_s=4",
        "--resilience.spike_threshold=6",
        "--resilience.on_spike=skip",
        f"--resilience.replay_interval={INTERVAL}",
        f"--checkpoint.interval={INTERVAL}",
        "--checkpoint.async_mode=async",
        "--checkpoint.keep_last_n=2",
        "--metrics.log_interval=1",
        "--eval.interval=0",
        "--data.verify_checksum=false",
    ]


def torchrun(
    run_dir: pathlib.Path, args: Sequence[str], faults: str, log, store: Store | None = None
) -> subprocess.Popen:
    """One launch: torchrun's agent and two workers (no restarts: the soak is the
    scheduler); its checkpoints in ``store`` under the run directory's name when given."""
    where = store.args(run_dir.name) if store is not None else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=0", str(REPO / "scripts" / "train.py"), *args, *where,
           f"--run.dir={run_dir}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FORGE_FAULTS": faults}
    env |= store.env() if store is not None else {}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def workers(agent: int) -> dict[int, int]:
    """The agent's workers by rank (read from their environment)."""
    found = {}
    for children in pathlib.Path(f"/proc/{agent}/task").glob("*/children"):
        for pid in map(int, children.read_text().split()):
            try:
                environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for entry in environ:
                if entry.startswith(b"RANK="):
                    found[int(entry[5:])] = pid
    return found


def steps_logged(run_dir: pathlib.Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            steps.append(record["step"])
    return steps


@attrs.frozen
class Recovery:
    kind: Kind
    step: int  # the step the fault came at
    resumed: int  # the step the next launch resumed from
    seconds: float  # the fault to the first step after it
    down: float  # the fault to the next launch's start
    imports: float  # the next launch's interpreter and imports (its ledger)
    setup: float  # its set-up: config, process group, model, data
    load: float  # its checkpoint resolved and loaded
    verify: float  # the checkpoint's bytes checked


def send(fault: Fault, agent: subprocess.Popen, store: Store | None = None) -> None:
    """Deliver a process fault to the running launch (or its store)."""
    if fault.kind is Kind.STORE_STALL:
        if store is not None:
            store.server.send_signal(signal.SIGSTOP)
            time.sleep(STORE_STALL_S)  # a save in flight or committing then fails, named
            store.server.send_signal(signal.SIGCONT)
        return
    ranks = workers(agent.pid)
    if fault.kind is Kind.TERM_JOB:
        agent.send_signal(signal.SIGTERM)
        return
    pid = ranks.get(fault.rank)
    if pid is None:
        return
    if fault.kind is Kind.STALL_RANK:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(COLLECTIVE_TIMEOUT_S + 5)  # its peer's collective times out: HEALTH_FAILURE
        os.kill(pid, signal.SIGCONT)
    else:
        os.kill(pid, signal.SIGKILL)


def soak(
    work: pathlib.Path,
    data: pathlib.Path,
    steps: int,
    faults: list[Fault],
    store: Store | None = None,
) -> dict[str, object]:
    """Run the job under ``faults`` until it completes, then the reference; the report.
    With ``store``, both keep their checkpoints in it (``store_stall`` needs one)."""
    args = config_args(data, steps)
    env_faults = in_job_env(faults)
    pending = [f for f in faults if f.kind in PROCESS]
    run_dir = work / "run"
    recoveries: list[Recovery] = []
    sent: list[Fault] = []
    launches = 0
    started = time.time()
    # a fault sent and not yet recovered from: it, when, the step reached, launches so far
    open_fault: tuple[Fault, float, int, int] | None = None
    with (work / "soak.log").open("ab") as log:
        while True:
            launches += 1
            if launches > len(faults) + 5:
                raise RuntimeError(f"no completion after {launches - 1} launches; see {work}")
            begun = time.time()
            agent = torchrun(run_dir, args, env_faults, log, store)
            before = max(steps_logged(run_dir), default=0)
            while agent.poll() is None:
                reached = max(steps_logged(run_dir), default=0)
                outlived = open_fault is not None and open_fault[0].kind in OUTLIVED
                if outlived and reached > open_fault[2] + 1:
                    fault, at, at_step, _ = open_fault  # a stall the launch outlived
                    recoveries.append(Recovery(fault.kind, at_step, at_step, time.time() - at,
                                               0.0, 0.0, 0.0, 0.0, 0.0))  # fmt: skip
                    open_fault = None
                if open_fault is not None:  # recovered once a later launch logs a step
                    ledger = read_ledger(run_dir / "goodput.jsonl")
                    if len(ledger) > open_fault[3]:
                        fault, at, at_step, _ = open_fault
                        first = ledger[open_fault[3]].seconds
                        recoveries.append(
                            Recovery(
                                fault.kind, at_step, ledger[open_fault[3]].step - 1,
                                time.time() - at, begun - at, first.get("imports", 0.0),
                                first.get("setup", 0.0), first.get("load", 0.0),
                                first.get("verify", 0.0),
                            )
                        )  # fmt: skip
                        open_fault = None
                due = open_fault is None and pending and reached >= pending[0].step
                if due and (reached > before or before == 0):  # this launch reached it
                    fault, at = pending.pop(0), time.time()
                    send(fault, agent, store)
                    sent.append(fault)
                    launched = len(read_ledger(run_dir / "goodput.jsonl"))
                    open_fault = (fault, at, reached, launched)
                if time.time() - begun > LAUNCH_LIMIT:
                    agent.kill()
                time.sleep(0.05)
            if agent.returncode == 0 and max(steps_logged(run_dir), default=0) >= steps:
                if open_fault is not None:  # it came as the run ended: nothing to recover
                    fault, at, at_step, _ = open_fault
                    recoveries.append(Recovery(fault.kind, at_step, at_step, 0.0,
                                               0.0, 0.0, 0.0, 0.0, 0.0))  # fmt: skip
                break  # complete; a fault the run outran was never sent
    wall = time.time() - started
    reference = work / "reference"
    with (work / "reference.log").open("ab") as log:
        if torchrun(reference, args, env_faults, log, store).wait() != 0:
            raise RuntimeError(f"the reference run failed; see {work / 'reference.log'}")
    identical = same_weights(run_dir, reference, steps, store)
    identical = identical and losses(run_dir) == losses(reference)
    recovered = len(recoveries) == len(sent)
    totals = run_totals(read_ledger(run_dir / "goodput.jsonl"))
    return {
        "faults": len([f for f in faults if f.kind not in PROCESS]) + len(sent),
        "kinds": {
            k.value: sum(
                f.kind is k for f in (*sent, *(f for f in faults if f.kind not in PROCESS))
            )
            for k in Kind
        },
        "launches": launches,
        "completed": True,
        "recovered": f"{len(recoveries)}/{len(sent)}"
        if recovered
        else f"{len(recoveries)}/{len(sent)} (a fault's launch died again before logging a step)",
        "bit_identical": identical,
        "records_lost": records_lost(run_dir, steps),
        "recovery": recovery_table(recoveries),
        "recomputed_steps": sum(max(0, r.step - r.resumed) for r in recoveries),
        "goodput": round(goodput(totals), 3),
        "buckets_s": {b.value: round(s, 1) for b, s in totals.items()},
        "wall_s": round(wall, 1),
    }


def recovery_table(recoveries: Sequence[Recovery]) -> dict[str, dict[str, float]]:
    """Per kind: the count, the median and max time to recover, and the median parts."""
    table = {}
    for kind in PROCESS:
        mine = [r for r in recoveries if r.kind is kind]
        if not mine:
            continue
        table[kind.value] = {
            "count": len(mine),
            "median_s": round(statistics.median(r.seconds for r in mine), 2),
            "max_s": round(max(r.seconds for r in mine), 2),
            **{
                f"{part}_s": round(statistics.median(getattr(r, part) for r in mine), 2)
                for part in ("down", "imports", "setup", "load", "verify")
            },
            "recomputed_steps": round(statistics.mean(max(0, r.step - r.resumed) for r in mine), 1),
        }
    return table


def losses(run_dir: pathlib.Path) -> list[tuple[int, str]]:
    """Each step's loss as its record says it (a NaN included): the final metrics.jsonl."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out.append((record["step"], repr(record["loss"])))
    return out


def records_lost(run_dir: pathlib.Path, steps: int) -> int:
    """Steps with no record in metrics.jsonl (a resumed run reads as one uninterrupted)."""
    return len(set(range(1, steps + 1)) - {s for s, _ in losses(run_dir)})


def same_weights(
    run: pathlib.Path, reference: pathlib.Path, steps: int, store: Store | None = None
) -> bool:
    """Whether the two final checkpoints hold the same tensors, bit for bit (fetched from
    ``store`` first when they are there)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        states = []
        for i, root in enumerate((run, reference)):
            out = pathlib.Path(tmp) / f"{i}.pt"
            folder = root / "checkpoints" / f"step_{steps}"
            if store is not None:
                from tests.object_store import s3

                folder = pathlib.Path(tmp) / f"step_{i}"
                s3(store.endpoint).get(f"{store.bucket}/{root.name}/step_{steps}/", str(folder),
                                       recursive=True)  # fmt: skip
            dcp_to_torch_save(str(folder), str(out))
            states.append(torch.load(out, weights_only=False))
    flat = [dict(flatten(s)) for s in states]
    if flat[0].keys() != flat[1].keys():
        return False
    return all(
        torch.equal(a, flat[1][k]) if isinstance(a, torch.Tensor) else a == flat[1][k]
        for k, a in flat[0].items()
    )


def flatten(value: object, prefix: str = ""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from flatten(v, f"{prefix}{k}.")
    else:
        yield prefix, value


REPORT_KEYS = frozenset({"faults", "kinds", "launches", "recovered", "bit_identical", "recovery"})


def is_report(path: pathlib.Path) -> bool:
    """Whether ``path`` holds a report this script wrote (it may be written over): a JSON
    object with every key of one."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False
    return isinstance(report, dict) and report.keys() >= REPORT_KEYS


def kinds_of(text: str) -> list[Kind] | str:
    """The fault kinds ``--kinds`` names, or why it names none that exist."""
    names = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [n for n in names if n not in {k.value for k in Kind}]
    if unknown or not names:
        known = ", ".join(k.value for k in Kind)
        wrong = ", ".join(unknown) or "no kind"
        return f"--kinds {text!r}: {wrong} is no fault kind; name some of {known}"
    return [Kind(n) for n in names]


# the job's own rule: its spike rule (spike_threshold) first judges the step after its warm-up
MIN_STEPS = SPIKE_WARMUP + 1


def steps_problem(steps: int, faults: int) -> str | None:
    """Why the job cannot run ``steps`` steps with ``faults`` faults, or None."""
    if steps < MIN_STEPS:
        return (
            f"--steps {steps}: the soak's job needs {MIN_STEPS} at least (its spike rule's warm-up)"
        )
    if faults < 0:
        return f"--faults {faults}: must be 0 or more"
    return None


def out_problem(out: pathlib.Path | None) -> str | None:
    """Why ``--out`` may not be written (forge's rule for a script's one file), or None."""
    return None if out is None else file_output_problem(out, "--out", "soak", is_report)


def work_problem(work: pathlib.Path | None) -> str | None:
    """The soak trains in ``--work``: a folder of its own, absent or empty (a run already
    there would be resumed, and the soak's figures with it)."""
    if work is None:
        return None
    resolved = work.resolve()
    if (run := enclosing_run(resolved)) is not None:
        return f"--work {work}: lies in the run or checkpoint directory {run}; name a new folder"
    if (dataset := enclosing_dataset(resolved)) is not None:
        return f"--work {work}: lies inside the dataset {dataset}; name a new folder"
    if work.exists() and (not work.is_dir() or any(work.iterdir())):
        return f"--work {work}: exists and is not an empty folder; name a new one"
    return None


@contextlib.contextmanager
def moto_store() -> Iterator[Store]:
    """moto's S3 server on a free local port and a new bucket (``tests/object_store.py``)."""
    from tests.object_store import moto_process, new_bucket

    with moto_process() as (endpoint, server):
        yield Store(endpoint, new_bucket(endpoint), server)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60, help="the job's train.max_steps")
    parser.add_argument("--data", type=pathlib.Path, default=REPO / "data" / "stdlib")
    parser.add_argument(  # store_stall needs moto (the dev extra): asked for by name
        "--kinds", default=",".join(k.value for k in Kind if k is not Kind.STORE_STALL)
    )
    parser.add_argument("--work", type=pathlib.Path, help="keep the runs here (default: temp)")
    parser.add_argument("--out", type=pathlib.Path, help="also write the report as JSON")
    args = parser.parse_args(argv)
    kinds = kinds_of(args.kinds)
    checks = (
        out_problem(args.out),
        work_problem(args.work),
        steps_problem(args.steps, args.faults),
    )
    problems = [p for p in (*checks, kinds if isinstance(kinds, str) else None) if p]
    if problems:
        print_errors(problems)
        return 2
    assert not isinstance(kinds, str)
    if Kind.STORE_STALL in kinds and importlib.util.find_spec("moto") is None:
        print_errors(["--kinds store_stall: needs moto's S3 server: pip install -e '.[dev]'"])
        return 2
    try:
        faults = plan_faults(args.seed, args.faults, args.steps, kinds)
    except ValueError as exc:
        print_errors([str(exc)])
        return 2
    print(f"{len(faults)} faults: " + ", ".join(f"{f.kind.value}@{f.step}" for f in faults))
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        work = args.work or pathlib.Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        store = stack.enter_context(moto_store()) if Kind.STORE_STALL in kinds else None
        try:
            report = soak(work, args.data, args.steps, faults, store)
        except RuntimeError as exc:  # the job did not complete: its logs are in work
            keep = "" if args.work else " (a temporary folder, now removed: pass --work to keep it)"
            print_errors([f"{exc}{keep}"])
            return 1
    print(json.dumps(report, indent=2))
    if args.out is not None:
        replace_file(args.out, json.dumps(report, indent=2) + "\n")
    return 0 if report["bit_identical"] and not report["records_lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
