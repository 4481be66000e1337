"""Expert parallelism: each rank of the ``ep`` group holds ``E / ep`` of every MoE layer's
experts, and tokens travel to them by all-to-all (``MoE.dispatched``).

The expert weights become DTensors sharded on the expert dimension, so checkpoints hold the
full ``(E, ...)`` tensors and a run saved at one ``ep`` loads at another. FSDP2 leaves them
alone (they are already split over the data-parallel ranks the ``ep`` group spans); their
gradients are scaled by ``1 / ep`` in backward, because each expert's gradient sums the
contributions of every rank's tokens while the dense gradients are averaged over ranks.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from forge.model.moe import MoE


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> set[nn.Parameter]:
    """Shard every MoE layer's experts over ``ep_mesh`` and give the layer its all-to-all
    group; returns the expert parameters (for FSDP2 to ignore)."""
    ep = ep_mesh.size()
    sharded: set[nn.Parameter] = set()
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        for name in ("w1", "w2", "w3"):
            weight = getattr(experts, name)
            param = nn.Parameter(distribute_tensor(weight.data, ep_mesh, [Shard(0)]))
            setattr(experts, name, param)
            sharded.add(param)
        experts.grad_scale = 1.0 / ep
        module.ep_group = ep_mesh.get_group()
        module.ep_size = ep
    return sharded
