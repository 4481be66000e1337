"""The short fault soak of default CI: a real 2-rank torchrun job killed, stopped, fed a NaN
and a spike, relaunched until it completes, ends bit-identical to the job never interrupted
(``benchmarks/soak.py``; its long run's figures are in docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("soak", REPO / "benchmarks" / "soak.py")
assert spec and spec.loader
SOAK = importlib.util.module_from_spec(spec)
spec.loader.exec_module(SOAK)
K = SOAK.Kind


# (case, kinds, count, steps): what the plan must hold whatever the seed
PLANS = [
    ("every kind once", list(K), 8, 40),
    ("in-job faults only", [K.NAN, K.SPIKE, K.CORRUPT], 9, 40),
    ("process faults only", list(SOAK.PROCESS), 8, 20),
]


@pytest.mark.parametrize("kinds,count,steps", [p[1:] for p in PLANS], ids=[p[0] for p in PLANS])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_plan_places_each_fault_where_it_can_act(kinds, count, steps, seed):
    faults = SOAK.plan_faults(seed, count, steps, kinds)
    assert len(faults) == count and faults == sorted(faults, key=lambda f: (f.step, f.kind.value))
    assert {f.kind for f in faults} == set(kinds)  # each kind in turn
    in_job = [f.step for f in faults if f.kind not in SOAK.PROCESS]
    assert len(in_job) == len(set(in_job))  # one in-job fault a step: each acts alone
    for f in faults:
        assert 2 <= f.step < steps and f.rank in (0, 1)
        if f.kind is K.SPIKE:  # after the loss statistics' warm-up
            assert f.step >= 12
        if f.kind in (K.CORRUPT, K.KILL_IN_SAVE):  # a replayed step, a save step
            assert f.step % SOAK.INTERVAL == 0
    assert SOAK.plan_faults(seed, count, steps, kinds) == faults  # the seed decides


def test_a_short_soak_recovers_every_fault_bit_identically(tmp_path, small_corpus):
    faults = [
        SOAK.Fault(K.KILL_RANK, 7, rank=1),
        SOAK.Fault(K.NAN, 9),
        SOAK.Fault(K.TERM_JOB, 12),
        SOAK.Fault(K.SPIKE, 14),
    ]
    report = SOAK.soak(tmp_path, small_corpus, 18, faults)
    print(json.dumps(report, indent=2))
    assert report["bit_identical"] is True
    assert report["records_lost"] == 0
    assert report["recovered"] == "2/2"
    assert set(report["recovery"]) == {"kill_rank", "term_job"}
    assert report["recovery"]["kill_rank"]["recomputed_steps"] >= 1  # steps past its save
    assert 0 < report["goodput"] < 1


def test_the_soak_writes_over_no_file_or_folder_it_did_not_make(tmp_path, capsys):
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "kept.txt").write_text("mine")
    argv = ["--out", str(tmp_path / "notes.json"), "--work", str(tmp_path / "work")]
    assert SOAK.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"error: --out {tmp_path / 'notes.json'}: holds a file forge did not")
    assert (
        err[1]
        == f"error: --work {tmp_path / 'work'}: exists and is not an empty folder; name a new one"
    )
    assert (tmp_path / "notes.json").read_text() == '{"mine": 1}'
    assert (tmp_path / "work" / "kept.txt").read_text() == "mine"
    assert SOAK.is_report(tmp_path / "notes.json") is False


# (case, arguments, the start of the one error line)
REFUSED = [
    ("an unknown kind", ["--kinds", "bogus"], "--kinds 'bogus': bogus is no fault kind"),
    ("no kind", ["--kinds", ","], "--kinds ',': no kind is no fault kind"),
    ("a job shorter than its spike rule's warm-up", ["--steps", "5"], "--steps 5: the soak's job needs 11"),
    ("more in-job faults than steps for them", ["--steps", "11", "--faults", "40", "--kinds", "nan"], "--faults 40 --steps 11: no step left for a nan fault"),
    ("a spike with no step past the warm-up", ["--steps", "12", "--faults", "1", "--kinds", "spike"], "--faults 1 --steps 12: no step left for a spike fault"),
    ("a negative count", ["--faults", "-1"], "--faults -1: must be 0 or more"),
]  # fmt: skip


@pytest.mark.parametrize("argv,line", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_the_soak_refuses_what_it_cannot_run_in_one_line(argv, line, capsys):
    assert SOAK.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {line}"), err


def test_the_soak_keeps_its_work_out_of_runs_and_datasets(tmp_path, small_corpus, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text("")
    for work, words in [(run / "checkpoints" / "soak", "lies in the run"), (small_corpus / "soak", "lies inside the dataset")]:  # fmt: skip
        assert SOAK.main(["--work", str(work)]) == 2
        assert words in capsys.readouterr().err
        assert not work.exists()


@pytest.mark.parametrize("text", ['"my notes: not bit_identical"', '{"bit_identical": true}'])
def test_only_a_whole_report_counts_as_the_soak_s_own_file(tmp_path, text):
    (tmp_path / "notes.json").write_text(text)
    assert SOAK.is_report(tmp_path / "notes.json") is False
