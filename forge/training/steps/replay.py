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
import warnings
from collections.abc import Callable, Iterator, MutableMapping, Sequence

import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor

from forge.data.batch import Batch
from forge.training.loop.plan import ReplayRule
from forge.training.steps.common import StepTotals
from forge.types import ReplayVerdict

Computation = Callable[[int], StepTotals]  # the computation's index (0, 1, 2) -> its totals
# a step's micro-batches and number -> its computation (``text_computation``, ...)
StepComputation = Callable[[tuple[Batch, ...], int], Computation]


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local elements as integers of the same width (its bits, flattened)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach().contiguous().view(_INT_OF_WIDTH[local.element_size()]).reshape(-1)


DIGEST_CHUNK = 1 << 22  # elements digested at once: bounds the int64 temporaries (~100 MB)


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``tensor``'s bits (wrapping): plain, and each element weighted by
    its position. A changed element always changes the first; changes that cancel in it
    (or the same change in another place) change the second. Chunk by chunk, so that a
    large gradient needs no int64 copy of its own size."""
    flat = bits(tensor)
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), DIGEST_CHUNK):
        b = flat[start : start + DIGEST_CHUNK].to(torch.int64)
        where = torch.arange(start + 1, start + b.numel() + 1, dtype=torch.int64, device=b.device)
        sums += torch.stack([b.sum(), (b * where).sum()])
    return sums


def digest(totals: StepTotals) -> torch.Tensor:
    """The digest of one computation: the loss (and any other totals it measured) and every
    gradient this rank holds, in parameter order."""
    measured = (totals.loss, totals.z_loss, totals.moe, totals.sources)  # this rank's own
    grads = [p.grad for p in totals.params if p.grad is not None]
    parts = [tensor_digest(t) for t in (*measured, *grads) if t is not None]
    return torch.stack(parts)


def ranks_where(
    flags: Sequence[bool], world_size: int, rank: int, device: torch.device
) -> list[tuple[int, ...]]:
    """For each of this rank's ``flags``, the ranks where it is set, agreed by every rank in
    one all-reduce."""
    if world_size == 1:
        return [(0,) if flag else () for flag in flags]
    table = torch.zeros(len(flags), world_size, device=device)
    table[:, rank] = torch.tensor([float(f) for f in flags], device=device)
    torch_dist.all_reduce(table)
    return [tuple(int(r) for r in row.nonzero().flatten().tolist()) for row in table]


REPLICATED_DIMS = ("dp_replicate", "tp")  # mesh dims along which a Replicate()d value is equal


def replica_groups(
    params: Sequence[torch.Tensor],
) -> list[tuple[torch_dist.ProcessGroup, list[torch.Tensor]]]:
    """The gradients this rank holds that other ranks must hold bit for bit (a DTensor
    replicated along an HSDP replica dim or a tensor-parallel dim), by the group of ranks
    that hold them, in one order on every rank (by dim name, then ranks)."""
    groups: dict[tuple[str, tuple[int, ...]], tuple[torch_dist.ProcessGroup, list]] = {}
    for p in params:
        grad = p.grad
        if not isinstance(grad, DTensor):
            continue
        for dim, name in replicated_along(grad):
            group = grad.device_mesh.get_group(dim)
            key = (name, tuple(torch_dist.get_process_group_ranks(group)))
            groups.setdefault(key, (group, []))[1].append(grad)
    return [groups[key] for key in sorted(groups)]


def replicated_along(tensor: torch.Tensor) -> list[tuple[int, str]]:
    """The mesh dims (index, name) along which other ranks hold ``tensor`` bit for bit: a
    DTensor ``Replicate()``d along an HSDP replica dim or a tensor-parallel dim of size > 1
    (what the replica comparison compares; a parameter's gradient has its placements)."""
    if not isinstance(tensor, DTensor):
        return []
    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names or ()
    return [
        (dim, name)
        for dim, (name, placement) in enumerate(zip(names, tensor.placements, strict=False))
        if name in REPLICATED_DIMS and placement.is_replicate() and mesh.size(dim) > 1
    ]


def diverges_from_replicas(params: Sequence[torch.Tensor]) -> bool:
    """Whether this rank's replicated gradients differ from those of most of a group that
    must hold them equal (with no majority, every member of the group diverges)."""
    diverged = False
    for group, grads in replica_groups(params):  # every group's gather runs, on every member
        mine = torch.stack([tensor_digest(g) for g in grads])
        theirs = [torch.empty_like(mine) for _ in range(torch_dist.get_world_size(group))]
        torch_dist.all_gather(theirs, mine, group=group)
        agreeing = sum(torch.equal(mine, other) for other in theirs)
        diverged |= 2 * agreeing <= len(theirs)
    return diverged


# torch's words after an operation's name when it ran without a deterministic kernel: its
# alert's, and the memory-efficient attention backward's own (warned once a process, so the
# start-up's probe is where it is seen)
NONDETERMINISTIC = (
    " does not have a deterministic implementation",
    " defaults to a non-deterministic algorithm",
)


def nondeterministic_operation(message: str) -> str | None:
    """The operation a torch warning says ran without a deterministic kernel, or None."""
    return next((message.split(words)[0] for words in NONDETERMINISTIC if words in message), None)


def checks_kernels(device: torch.device) -> bool:
    """Whether a replay on ``device`` asks torch which operations ran without a
    deterministic kernel: on CUDA. A CPU's kernels are deterministic already (forge's step
    runs none of the few that torch names there), so a CPU run pays nothing for the question."""
    return device.type == "cuda"


@contextlib.contextmanager
def deterministic_kernels(device: torch.device) -> Iterator[list[str]]:
    """On CUDA (``checks_kernels``), deterministic kernels for the computations compared
    (cuBLAS also needs ``CUBLAS_WORKSPACE_CONFIG``, set before CUDA starts:
    ``cuda_determinism_env``); yields the operations that ran without one (torch warns of
    each): their results may differ between computations on healthy hardware."""
    if not checks_kernels(device):
        yield []
        return
    with kernels_named() as unverifiable:
        yield unverifiable


@contextlib.contextmanager
def kernels_named() -> Iterator[list[str]]:
    """Deterministic kernels where torch has them, on any device; yields the operations
    that ran without one, as torch names them (filled on the way out)."""
    unverifiable: list[str] = []
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield unverifiable
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
    for w in caught:
        if (operation := nondeterministic_operation(str(w.message))) is not None:
            unverifiable.append(operation)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def unverifiable_operations(
    compute: Computation, reset: Callable[[], None], device: torch.device
) -> tuple[str, ...]:
    """The operations that one run of ``compute`` (a step's first computation) runs without a
    deterministic kernel, as torch names them, checked once at start-up where replays are
    configured: a replay of such a step could not tell a fault from noise. Afterwards the
    gradients are dropped (``reset``) and the RNG streams are where they were, so a probed
    launch trains exactly as an unprobed one."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        with kernels_named() as unverifiable:
            compute(0)
    finally:
        reset()
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    return tuple(sorted(set(unverifiable)))


def cuda_determinism_env(env: MutableMapping[str, str]) -> None:
    """What cuBLAS needs for deterministic kernels, set in ``env`` before CUDA starts (unless
    the user set it)."""
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextlib.contextmanager
def kernel_modes_kept() -> Iterator[None]:
    """torch's deterministic-kernel settings put back on the way out: a run inside a running
    process (a test, a notebook) changes them for itself only (``use_deterministic_kernels``).
    A decorator of the train script's ``main``."""
    saved = kernel_modes()
    try:
        yield
    finally:
        # only when changed: a signal that ends set-up inside an import of torch._inductor
        # leaves it half-initialised, and setting the modes imports its config
        if kernel_modes()[:2] != saved[:2]:
            torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:]


def kernel_modes() -> tuple[bool, bool, bool, bool]:
    """torch's deterministic-kernel settings: deterministic algorithms, warn only, cuDNN's
    deterministic and benchmark flags."""
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )


def use_deterministic_kernels() -> None:
    """``train.deterministic``: every operation runs a deterministic kernel, or torch raises
    naming it (``torch.use_deterministic_algorithms``); cuDNN picks no kernel by timing. CPU
    kernels already are: there it changes no bit (tested)."""
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def deterministic_line(device_type: str) -> str:
    """The start-up line of ``train.deterministic`` on a ``device_type`` device."""
    line = "deterministic: every operation runs a deterministic kernel, or torch names it"
    if device_type == "cuda":
        return f"{line}; cuDNN picks no kernel by timing; cuBLAS's workspace fixed"
    return f"{line} (a CPU's kernels already are: no bit changes)"


class Replayer:
    """Runs a step's computation once, or replays it (``rule``), for one launch: the first
    step this launch runs counts as its first step. Where an operation has no deterministic
    kernel (CUDA), a replay cannot tell a fault from noise: the first such step's verdict says
    so (not compared), and replays stop for the launch."""

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

    def __call__(self, step: int, compute: Computation) -> tuple[StepTotals, ReplayVerdict | None]:
        """The computation's totals (gradients in the parameters) and, for a replayed step,
        the verdict every rank agreed on."""
        first, self.launched = not self.launched, True
        if not self.rule.replays(step, first):
            return compute(0), None
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        with deterministic_kernels(self.device) as unverifiable:
            first_digest = digest(compute(0))
            self.again(rng, cuda_rng)
            totals = compute(1)
            second_digest = digest(totals)
        differs = not torch.equal(first_digest, second_digest)
        mismatched, diverged, noisy = self.agreed(differs, totals, bool(unverifiable))
        if noisy:
            return totals, self.give_up(unverifiable)
        if not mismatched:
            return totals, ReplayVerdict(diverged=diverged)
        with deterministic_kernels(self.device):
            self.again(rng, cuda_rng)
            totals = compute(2)
            third_digest = digest(totals)
        alone = not any(torch.equal(third_digest, d) for d in (first_digest, second_digest))
        inconsistent, diverged, _ = self.agreed(alone, totals, False)
        return totals, ReplayVerdict(mismatched, inconsistent, diverged)

    def give_up(self, unverifiable: list[str]) -> ReplayVerdict:
        """Stop replaying for this launch (some operation has no deterministic kernel); the
        verdict of a step that could not be compared, naming this rank's such operations."""
        self.rule = ReplayRule()
        return ReplayVerdict(compared=False, unverifiable=tuple(sorted(set(unverifiable))))

    def agreed(self, flag: bool, totals: StepTotals, unverifiable: bool) -> list[tuple[int, ...]]:
        """The ranks where ``flag`` is set, those whose replicated gradients diverge from
        their replicas', and those that ran an operation without a deterministic kernel,
        agreed by every rank in one all-reduce."""
        diverged = self.world_size > 1 and diverges_from_replicas(totals.params)
        flags = [flag, diverged, unverifiable]
        return ranks_where(flags, self.world_size, self.rank, self.device)

    def again(self, rng: torch.Tensor, cuda_rng: torch.Tensor | None) -> None:
        """Back to where the step's first computation started: no gradients, the same RNG."""
        self.reset()
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, self.device)
