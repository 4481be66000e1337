"""torchrun worker: build models on the meta device under several layouts, initialise each
rank's shards, and write every parameter's full-value digest (rank 0) to ``argv[1]``.

Layouts over the world's ranks: FSDP2 over all of them, FSDP2 over pairs, TP over pairs, FSDP2
× TP (2-D), and (for a mixture of experts) EP over pairs, so one 4-rank launch covers 4-, 2-
and 2 × 2-way splits.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from forge.config.sections import ActivationCheckpointing, ModelConfig, Precision
from forge.model.init import local_region
from forge.model.transformer import Transformer
from forge.parallel.parallelize import parallelize

# wider than one 256 tile and not a multiple of it (uneven shards cut tiles); GQA; MoE
DENSE = ModelConfig(dim=320, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=600, max_seq_len=16)
MOE = ModelConfig(
    dim=320, n_layers=2, n_heads=4, vocab_size=600, max_seq_len=16, moe_num_experts=4, moe_top_k=2
)


def fallbacks(model: torch.nn.Module) -> list[str]:
    """The parameters whose shard is not computed alone (the full value is built instead)."""
    return [name for name, p in model.named_parameters() if local_region(p) is None]


def digests(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of every parameter's full value (gathered from its shards)."""
    out = {}
    for name, p in model.named_parameters():
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        out[name] = hashlib.sha256(full.contiguous().numpy().tobytes()).hexdigest()
    return out


def built(cfg: ModelConfig, **meshes: DeviceMesh | None) -> dict[str, str]:
    """The full-value digests of ``cfg`` built under ``meshes`` (and its ``fallbacks``)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(
        model,
        tp_mesh=meshes.get("tp"),
        dp_mesh=meshes.get("dp"),
        precision=Precision.FP32,
        activation_checkpointing=ActivationCheckpointing.NONE,
        compile_blocks=False,
        ep_mesh=meshes.get("ep"),
    )
    model.materialize("cpu")
    model.init_weights(seed=7)
    return {**digests(model), "fallbacks": ",".join(fallbacks(model))}


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("all",))
    pairs = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("outer", "pair"))["pair"]
    grid = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    result = {
        f"dense fsdp={world}": built(DENSE, dp=flat["all"]),
        "dense fsdp=2": built(DENSE, dp=pairs),
        "dense tp=2": built(DENSE, tp=pairs),
        f"dense fsdp={world // 2} x tp=2": built(DENSE, dp=grid["dp"], tp=grid["tp"]),
        f"moe fsdp={world}": built(MOE, dp=flat["all"]),
        "moe ep=2": built(MOE, ep=pairs),
    }
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
