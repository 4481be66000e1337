"""Context parallelism (``distributed.cp``), all-gather form: the model's side.

Each context-parallel rank holds the same rows as its peers (they share ``dp_rank``) and
keeps its head–tail part of every row's tokens (``forge.data.context_split``, applied by the
loader). ``apply_context_parallel`` hands the model its group: every attention layer then
all-gathers keys and values over it (``forge.model.context_attention``). Gradients are
averaged over ``dp × cp`` by FSDP2 over ``forge.parallel.mesh.data_parallel_mesh``.
``whole_rows`` sets the group aside while downstream tasks score whole rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from forge.model.transformer import Transformer


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh | None) -> None:
    """Set ``cp_mesh``'s group on ``model`` (a ``Transformer``, FSDP-wrapped or not); nothing
    without one (``distributed.cp`` 1)."""
    if cp_mesh is None:
        return
    if not isinstance(model, Transformer):
        raise TypeError(f"context parallelism needs a Transformer, got {type(model).__name__}")
    model.context_group = cp_mesh.get_group()


@contextlib.contextmanager
def whole_rows(model: nn.Module) -> Iterator[None]:
    """``model`` attending over whole rows while inside (downstream tasks hand every
    context-parallel rank the same whole requests): its context-parallel group set aside,
    and put back on the way out, an error's too. Nested, the inner one finds no group and
    does nothing; not for two threads at once (scoring runs on one)."""
    group = getattr(model, "context_group", None)
    if group is None:
        yield
        return
    assert isinstance(model, Transformer)
    model.context_group = None
    try:
        yield
    finally:
        model.context_group = group
