"""FP8 (``train.float8``, torchao's emulation on a CPU) at real ranks (torchrun, gloo) in
every layout of the composition table at 4 ranks (FSDP × TP in default CI, the others opt-in:
``FORGE_SLOW_TESTS=1``), in each parallelism alone at 2 (rowwise),
and on a mixture of experts under FSDP2 × expert parallelism at 2, against the same config without FP8 at one rank; every step also
checked against its high-precision recomputation (``train.float8_check = 1``: the drift
guard through each layout, the pipeline's schedule included), and none drifting.

The tolerance is measured, not assumed: over 3 steps of the tiny config, FP8 in any of these
layouts stayed within 1.2e-4 (relative) of the high-precision loss and eval loss and within
0.5% of its gradient norm (FP8 under TP and PP equal FP8 at one rank bit for bit: the
tensorwise scales are taken over whole tensors). The bounds below are those figures with
room: 1e-3 for the losses, 2% for the gradient norm.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO, layout_params
from tests.distributed.test_compositions import (
    LAYOUTS,
    ONE_RANK,
    THREE_STEPS,
    training_metrics,
    write_mixture_config,
)
from tests.distributed.test_equivalence import COMMON, train, weights
from tests.distributed.test_moe_parallel import EP, write_moe_config
from tests.distributed.test_moe_parallel import ONE_RANK as MOE_ONE_RANK
from tests.ranks import run_ranks

pytest.importorskip("torchao")  # the fp8 extra, in dev: runs in `make test`

LOSS_TOLERANCE, GRAD_NORM_TOLERANCE = 1e-3, 2e-2


def assert_within_tolerance(got: dict, ref: dict) -> None:
    for step in (1, 2, 3):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=LOSS_TOLERANCE), step
        assert got[step]["grad_norm"] == pytest.approx(
            ref[step]["grad_norm"], rel=GRAD_NORM_TOLERANCE
        ), step
    assert got[3]["eval/loss"] == pytest.approx(ref[3]["eval/loss"], rel=LOSS_TOLERANCE)


@pytest.fixture(scope="module")
def high_precision(tmp_path_factory, small_corpus, second_corpus):
    """The composition table's config and its one-rank run without FP8."""
    tmp = tmp_path_factory.mktemp("float8_reference")
    config = write_mixture_config(tmp, small_corpus, second_corpus)
    train(config, tmp / "one", *THREE_STEPS, *ONE_RANK)
    return config, tmp / "one"


# default CI: FSDP2 × TP, the layout FP8 training runs in (each parallelism alone runs at 2
# ranks below); the rest opt-in
@pytest.mark.parametrize("args", layout_params(LAYOUTS, {"fsdp x tp"}))
def test_fp8_in_each_composition_at_four_ranks_is_within_tolerance_of_high_precision(
    high_precision, tmp_path, args
):
    config, one = high_precision
    train(config, tmp_path / "run", *THREE_STEPS, *args, "--train.float8=tensorwise",
          "--train.float8_check=1", ranks=4)  # fmt: skip
    got = training_metrics(tmp_path / "run")
    assert_within_tolerance(got, training_metrics(one))
    # every step checked against high precision (one agreed verdict), none drifted
    assert all(got[s]["float8/grad_norm_drift"] < 0.05 for s in (1, 2, 3))


AT_TWO = ["--train.batch_size=4", "--train.grad_accum_steps=2", "--eval.steps=4"]


@pytest.mark.parametrize(
    "layout",
    [["--distributed.dp_shard=2", "--train.batch_size=2", "--train.grad_accum_steps=2",
      "--eval.steps=4"],
     ["--distributed.tp=2", "--distributed.dp_shard=1", *AT_TWO],
     ["--distributed.pp=2", "--distributed.dp_shard=1", *AT_TWO],
     ["--distributed.cp=2", "--distributed.dp_shard=1", *AT_TWO]],
    ids=["fsdp", "tp", "pp", "cp"],
)  # fmt: skip
def test_fp8_in_each_parallelism_at_two_ranks_is_within_tolerance_of_high_precision(
    high_precision, tmp_path, layout
):
    config, one = high_precision
    train(config, tmp_path / "run", *THREE_STEPS, *layout, "--train.float8=rowwise", ranks=2)
    assert_within_tolerance(training_metrics(tmp_path / "run"), training_metrics(one))


def test_fp8_on_experts_under_fsdp_x_ep_at_two_ranks_is_within_tolerance(tmp_path, small_corpus):
    """The experts stay in high precision (no ``Linear``); attention and shared layers FP8."""
    config = write_moe_config(tmp_path, small_corpus, "moe_first_dense = 1\n")
    train(config, tmp_path / "one", *THREE_STEPS, *MOE_ONE_RANK)
    train(config, tmp_path / "two", *THREE_STEPS, *EP, "--train.float8=rowwise",
          "--train.float8_check=1", ranks=2)  # fmt: skip
    assert_within_tolerance(training_metrics(tmp_path / "two"), training_metrics(tmp_path / "one"))


FSDP_AT_TWO = ["--distributed.dp_shard=2", "--train.batch_size=2", "--train.grad_accum_steps=2",
               "--eval.steps=4", "--train.float8=tensorwise"]  # fmt: skip


def test_fp8_weights_gathered_in_fp8_under_fsdp2_train_as_gathered_in_high_precision(
    high_precision, tmp_path
):
    """Under FSDP2 with tensorwise scaling the FP8 layers' weights are gathered in FP8 (cast
    with the whole tensor's scale, computed as each forward begins); with the drift guard on
    they are gathered in high precision and cast after. The same FP8 values: the same steps,
    bit for bit — a scale left from earlier weights would change them — the same
    high-precision weights in the checkpoint, and a resume that continues them exactly."""
    config, _ = high_precision
    argv = [str(REPO / "scripts" / "train.py"), str(config), *COMMON, *THREE_STEPS, *FSDP_AT_TWO]
    run, high = tmp_path / "gathered", tmp_path / "high"
    gathered = run_ranks(2, [*argv, f"--run.dir={run}"])
    assert gathered.returncode == 0, gathered.stderr[-3000:]
    assert "(their weights gathered in FP8 by FSDP2)" in gathered.stderr
    out = run_ranks(2, [*argv, f"--run.dir={high}", "--train.float8_check=1",
                        "--train.max_steps=4"])  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gathered in FP8" not in out.stderr
    resumed = run_ranks(2, [*argv, f"--run.dir={run}", "--train.max_steps=4"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, ref = training_metrics(run), training_metrics(high)
    for step in (1, 2, 3, 4):
        for key in ("loss", "grad_norm"):
            assert got[step][key] == ref[step][key], (step, key)
    assert got[3]["eval/loss"] == ref[3]["eval/loss"]
    saved, reference = weights(config, run, 2), weights(config, high, 2)
    assert all(torch.equal(saved[name], tensor) for name, tensor in reference.items())
