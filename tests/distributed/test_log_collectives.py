"""A logged step reduces all of its metrics over ranks in one collective, whatever metrics
the run has: 2 real ranks, a two-source mixture, a mixture-of-experts model, the z-loss and
the costs of the saves committed since the last log."""

from __future__ import annotations

import json

from tests.conftest import REPO
from tests.distributed.test_compositions import write_mixture_config
from tests.distributed.test_moe_parallel import MOE, MOE_METRICS
from tests.ranks import run_ranks

DRIVER = str(REPO / "tests" / "distributed" / "count_log_collectives.py")


def test_a_logged_step_makes_one_collective_at_two_ranks(tmp_path, small_corpus, second_corpus):
    config = write_mixture_config(tmp_path, small_corpus, second_corpus)
    config.write_text(config.read_text().replace("[model]\n", "[model]\n" + MOE, 1))
    run_dir = tmp_path / "run"
    args = [
        f"--run.dir={run_dir}",
        "--train.max_steps=4",
        "--train.z_loss_weight=1e-4",
        "--metrics.log_interval=2",  # step 3 is not logged: its sums join step 4's
        "--distributed.dp_shard=2",
        "--train.batch_size=2",
        "--checkpoint.interval=1",  # saves at 1 and 3 ride in the records of 2 and 4
        "--eval.interval=0",
    ]
    out = run_ranks(2, [DRIVER, str(config), *args])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 4]
    for record in logged:  # every family the one reduction carries is in the record
        assert {"loss", "z_loss", *MOE_METRICS} <= record.keys()
        assert {"data/json_email/loss", "data/unittest/tokens"} <= record.keys()
    assert [r.get("checkpoint/step") for r in logged] == [None, 1, 3]
    for rank in (0, 1):
        counts = json.loads((run_dir / f"log_collectives_rank{rank}.json").read_text())
        assert counts == [["all_reduce"]] * 3, rank
