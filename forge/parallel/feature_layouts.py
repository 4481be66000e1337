"""Model features whose layers have no tensor, pipeline or context-parallel plan yet: the
layouts they are refused in, one table."""

from __future__ import annotations

from forge.config.ranges import Problem
from forge.config.sections import JobConfig

# model features whose layers have no plan yet in some of the tensor, pipeline and
# context-parallel layouts: (the feature, whether a model uses it, those layouts)
SHARDED_ONLY = (("latent attention ([model.mla])", lambda m: m.mla is not None, ("cp",)),)


def sharded_only_problems(config: JobConfig, dims: object) -> list[Problem]:
    """The layouts a ``SHARDED_ONLY`` feature cannot run in, one line each (``dims``:
    ``forge.parallel.world.MeshDims``, read by name: that module calls this one)."""
    p: list[Problem] = []
    for what, used, layouts in SHARDED_ONLY:
        if not used(config.model):
            continue
        for dim in layouts:
            if getattr(dims, dim) > 1:
                p.append(
                    (
                        f"distributed.{dim}",
                        f"is not supported with {what} yet; use distributed.dp_shard / "
                        "dp_replicate / ep (FSDP2, HSDP, experts)",
                    )
                )
    return p
