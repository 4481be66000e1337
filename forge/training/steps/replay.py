"""Replayed steps: a step's gradients computed twice from the same batch and RNG state and
compared bitwise, a third time to outvote a mismatch (``resilience.replay_interval``).

forge's step is deterministic, so two computations of it on healthy hardware agree to the
bit: a replay needs no tolerance. Each rank digests its loss and every gradient it holds (its
shards, under FSDP); the ranks agree on which of them disagreed in one all-reduce of one flag
per rank. On a mismatch every rank computes a third time (the step's collectives need them
all): where the third agrees with either of the first two, two of three agree and the step
goes on with the third's gradients; where it agrees with neither, the step is not applied and
the run ends REPLAY_MISMATCH. The RNG state is restored before each computation, so that a
replayed step leaves the streams where one computation would have.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor

from forge.training.plan import ReplayRule
from forge.training.steps.common import StepTotals
from forge.types import ReplayVerdict

Computation = Callable[[int], StepTotals]  # the computation's index (0, 1, 2) -> its totals


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local elements as integers of the same width (its bits, flattened)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach().contiguous().view(_INT_OF_WIDTH[local.element_size()]).reshape(-1)


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``tensor``'s bits (wrapping): plain, and each element weighted by
    its position. A changed element always changes the first; changes that cancel in it
    (or the same change in another place) change the second."""
    b = bits(tensor).to(torch.int64)
    where = torch.arange(1, b.numel() + 1, dtype=torch.int64, device=b.device)
    return torch.stack([b.sum(), (b * where).sum()])


def digest(totals: StepTotals) -> torch.Tensor:
    """The digest of one computation: the loss (and any other totals it measured) and every
    gradient this rank holds, in parameter order."""
    measured = (totals.loss, totals.z_loss, totals.moe, totals.sources)  # this rank's own
    grads = [p.grad for p in totals.params if p.grad is not None]
    parts = [tensor_digest(t) for t in (*measured, *grads) if t is not None]
    return torch.stack(parts)


def ranks_where(flag: bool, world_size: int, rank: int, device: torch.device) -> tuple[int, ...]:
    """The ranks whose ``flag`` is set, agreed by every rank in one all-reduce."""
    if world_size == 1:
        return (0,) if flag else ()
    flags = torch.zeros(world_size, device=device)
    flags[rank] = float(flag)
    torch_dist.all_reduce(flags)
    return tuple(int(r) for r in flags.nonzero().flatten().tolist())


@contextlib.contextmanager
def deterministic_kernels(device: torch.device) -> Iterator[None]:
    """On CUDA, deterministic kernels for the computations compared (cuBLAS also needs
    ``CUBLAS_WORKSPACE_CONFIG``, set at start-up); CPU kernels are deterministic already."""
    if device.type != "cuda":
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


class Replayer:
    """Runs a step's computation once, or replays it (``rule``), for one launch: the first
    step this launch runs counts as its first step."""

    def __init__(
        self,
        rule: ReplayRule,
        reset: Callable[[], None],
        world_size: int,
        rank: int,
        device: torch.device,
    ) -> None:
        self.rule = rule
        self.reset = reset  # drops a computation's gradients before the next
        self.world_size, self.rank, self.device = world_size, rank, device
        self.launched = False
        replays = rule.interval > 0 or rule.first_step
        if replays and device.type == "cuda":  # cuBLAS reads it when its handle is made
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    def __call__(self, step: int, compute: Computation) -> tuple[StepTotals, ReplayVerdict | None]:
        """The computation's totals (gradients in the parameters) and, for a replayed step,
        the verdict every rank agreed on."""
        first, self.launched = not self.launched, True
        if not self.rule.replays(step, first):
            return compute(0), None
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        with deterministic_kernels(self.device):
            first_digest = digest(compute(0))
            self.again(rng, cuda_rng)
            totals = compute(1)
            second_digest = digest(totals)
            differs = not torch.equal(first_digest, second_digest)
            mismatched = ranks_where(differs, self.world_size, self.rank, self.device)
            if not mismatched:
                return totals, ReplayVerdict()
            self.again(rng, cuda_rng)
            totals = compute(2)
            third_digest = digest(totals)
        alone = not any(torch.equal(third_digest, d) for d in (first_digest, second_digest))
        inconsistent = ranks_where(alone, self.world_size, self.rank, self.device)
        return totals, ReplayVerdict(mismatched=mismatched, inconsistent=inconsistent)

    def again(self, rng: torch.Tensor, cuda_rng: torch.Tensor | None) -> None:
        """Back to where the step's first computation started: no gradients, the same RNG."""
        self.reset()
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, self.device)
