"""Apply parallelisms to a built model in one fixed order: FP8 layers → TP → EP → activation
checkpointing → FSDP2 → compile.

Why this order: FP8 swaps Linear layers for torchao's (a swapped module would lose the hooks a
plan put on it); TP rewrites the Linear layers into DTensor shards, so it must see the modules
as they will run; EP likewise shards the experts' weights; activation checkpointing wraps whole
blocks, TP-sharded or not; FSDP2 then shards whatever parameters exist (plain or TP DTensors, giving
2-D FSDP×TP), except the experts EP already split over the data-parallel ranks; compile comes
last so it traces the final modules, hooks included.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from forge.config.sections import ActivationCheckpointing, Float8Recipe, Precision
from forge.model.latent_attention import LatentAttention
from forge.model.moe import MoE
from forge.model.transformer import Transformer, TransformerBlock
from forge.model.vlm import VisionLanguageModel
from forge.parallel.context_parallel import apply_context_parallel
from forge.parallel.expert import apply_ep
from forge.parallel.float8 import apply_float8, scales_before_forward


def decoder_of(model: nn.Module) -> Transformer:
    """The text decoder: the model itself, or a vision-language model's ``decoder``."""
    if isinstance(model, VisionLanguageModel):
        return model.decoder
    assert isinstance(model, Transformer)
    return model


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one before the root: the decoder's blocks and, in a
    vision-language model, each cross-attention layer and the encoder's blocks (a Hugging
    Face tower as one unit)."""
    decoder = decoder_of(model)
    units: list[nn.Module] = list(decoder.layers.values())
    if decoder.mtp is not None:  # each multi-token depth resharded after its forward too
        units += list(decoder.mtp.values())
    if isinstance(model, VisionLanguageModel):
        if model.cross_attention is not None:
            units += list(model.cross_attention.values())
        blocks = getattr(model.vision_encoder, "blocks", None)
        units += (
            list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else [model.vision_encoder]
        )
    return units


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallelism: attention heads and FFN columns are split;
    norms and the residual stream are sharded along the sequence; a mixture-of-experts
    block's experts stay whole (``moe_plan``); a multi-token depth's block is planned as the
    model's, the rest of it on the sequence shards (``depth_plan``)."""
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)  # type: ignore[arg-type]
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block))
    for depth in model.mtp.values() if model.mtp is not None else ():
        parallelize_module(depth, tp_mesh, depth_plan())
        assert isinstance(depth.block, nn.Module)
        parallelize_module(depth.block, tp_mesh, block_plan(depth.block))


def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """A transformer block's plan: heads split over the attention projections
    (``latent_plan`` for latent attention), the norms on sequence shards, the
    feed-forward's (``dense_ffn_plan``, ``moe_plan``)."""
    assert isinstance(block, TransformerBlock)
    qk_norms: dict[str, ParallelStyle] = {}
    if getattr(block.attention, "q_norm", None) is not None:
        # q and k hold this rank's heads (dim 2): the norm's weight is replicated and each
        # rank normalises its own heads, returning plain local tensors to attention
        heads = SequenceParallel(sequence_dim=2, use_local_output=True)
        qk_norms = {"attention.q_norm": heads, "attention.k_norm": heads}
    attention: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
    }
    if isinstance(block.attention, LatentAttention):
        attention = latent_plan(block.attention)
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(  # (x, cos, sin, mask): only x is sharded
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        **attention,
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    ffn = moe_plan() if isinstance(block.feed_forward, MoE) else dense_ffn_plan()
    return qk_norms | plan | ffn


def latent_plan(attention: LatentAttention) -> dict[str, ParallelStyle]:
    """Latent attention's heads split: the up-projections to each head's query, key and value
    (``wq`` or ``wq_b``, ``wkv_b``) by columns, ``wo`` by rows; the compressions before them
    (``wq_a``, ``wkv_a``) and their norms are computed whole on every rank (``Replicated``):
    their output's gradient is complete where a column-split projection consumes it (its
    input's gradient is summed over the group), and summed here for the rotated key every
    head shares (the last ``rope_dim`` channels of ``wkv_a``'s output), of which each rank's
    heads give a part."""
    plan: dict[str, ParallelStyle] = {
        "attention.wkv_a": Replicated(sum_grad_from=attention.m.kv_rank),
        "attention.kv_norm": Replicated(),
        "attention.wkv_b": ColwiseParallel(),
    }
    if attention.wq is not None:
        return plan | {"attention.wq": ColwiseParallel()}
    return plan | {
        "attention.wq_a": Replicated(),
        "attention.q_a_norm": Replicated(),
        "attention.wq_b": ColwiseParallel(),
    }


class Replicated(ParallelStyle):
    """A module every tensor-parallel rank computes whole: its weights replicated DTensors
    (their gradients the same on every rank, from complete output gradients), its input taken
    as replicated, its output a plain tensor. With ``sum_grad_from``, the output's gradient
    in the channels from there on is summed over the group in backward (each rank's consumers
    give only a part of it)."""

    def __init__(self, sum_grad_from: int | None = None) -> None:
        super().__init__()
        self.sum_grad_from = sum_grad_from

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicated_inputs(_: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
            return tuple(
                x.redistribute(mesh, [Replicate()])
                if isinstance(x, DTensor)
                else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                for x in inputs
            )

        def local_output(_: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
            local = output.to_local()
            if self.sum_grad_from is None:
                return local
            return SumGradTail.apply(local, self.sum_grad_from, mesh.get_group())

        return distribute_module(
            module, device_mesh, input_fn=replicated_inputs, output_fn=local_output
        )


class SumGradTail(torch.autograd.Function):
    """Identity in forward; in backward the gradient's channels from ``start`` on are summed
    over ``group`` (the rest passes as it is)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, start: int, group: ProcessGroup) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        tail = grad[..., ctx.start :].contiguous()
        torch_dist.all_reduce(tail, group=ctx.group)
        return torch.cat([grad[..., : ctx.start], tail], dim=-1), None, None


def depth_plan() -> dict[str, ParallelStyle]:
    """A multi-token depth around its block: its two norms and the projection of the joined
    states work token by token on the sequence shards (weights replicated, their gradients
    summed over the group), returning plain shards as the blocks do; its final norm hands the
    head a sequence-sharded DTensor, as the model's final norm does."""
    local = SequenceParallel(use_local_output=True)
    return {"hidden_norm": local, "embed_norm": local, "proj": local, "norm": SequenceParallel()}


def dense_ffn_plan() -> dict[str, ParallelStyle]:
    """A SwiGLU block's FFN: columns of w1 and w3, rows of w2, back to the sequence shards."""
    return {
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def moe_plan() -> dict[str, ParallelStyle]:
    """A mixture-of-experts block's FFN keeps its experts whole (or split by expert
    parallelism): every tensor-parallel rank routes the whole sequence (gathered from the
    sequence shards) through the same experts, and keeps its own shard of the output. The
    experts' gradients are then the same on every tensor-parallel peer, as are the MoE
    statistics (the metrics' means and the bias update's signs count peers alike)."""
    return {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(Shard(1), None),  # (x, the MoE statistics)
            desired_input_layouts=(Replicate(), None),
            use_local_input=True,
            output_layouts=(Replicate(), None),
            desired_output_layouts=(Shard(1), None),
            use_local_output=True,  # the residual stream holds plain sequence shards
        )
    }


def apply_activation_checkpointing(model: nn.Module, mode: ActivationCheckpointing) -> None:
    """Wrap the decoder's blocks (and each multi-token depth's) so that their activations are
    recomputed in backward."""
    if mode is ActivationCheckpointing.NONE:
        return
    model = decoder_of(model)
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode is ActivationCheckpointing.FULL or i % 2 == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    for depth in model.mtp.values() if model.mtp is not None else ():  # a block each
        assert isinstance(depth.block, nn.Module)
        depth.block = checkpoint_wrapper(depth.block, preserve_rng_state=False)


def fsdp_policy(precision: Precision, param_dtype: Precision) -> MixedPrecisionPolicy:
    """FSDP2's dtypes from the two keys: bf16 compute over fp32 master weights casts the
    gathered parameters and reduces gradients in fp32; pure bf16 parameters stay as they are and
    reduce in bf16."""
    if param_dtype is Precision.BF16:
        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.bfloat16)
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision is Precision.BF16 else None,
        reduce_dtype=torch.float32,
    )


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    precision: Precision,
    param_dtype: Precision = Precision.FP32,
    experts_mesh: DeviceMesh | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """FSDP2 per block (``sharding_units``), then the root, with ``fsdp_policy``'s dtypes.
    Under expert parallelism each block's experts (already split over the ``ep`` ranks) are
    sharded over ``experts_mesh``, the remaining data-parallel ranks, first; where there are
    none they are ``ignored``."""
    mp = fsdp_policy(precision, param_dtype)
    for block in sharding_units(model):
        experts = expert_module(block)
        if experts is not None and experts_mesh is not None:
            fully_shard(experts, mesh=experts_mesh, mp_policy=mp)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored or None)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored or None)


def expert_module(block: nn.Module) -> nn.Module | None:
    """A block's routed experts, if it is a mixture of experts (through any wrapper)."""
    for module in block.modules():
        if isinstance(module, MoE):
            return module.experts
    return None


def apply_compile(model: nn.Module) -> None:
    """Compile each decoder block and depth block (one graph reused by every block of the
    same shape)."""
    decoder = decoder_of(model)
    for block in decoder.layers.values():
        block.compile()
    for depth in decoder.mtp.values() if decoder.mtp is not None else ():
        assert isinstance(depth.block, nn.Module)
        depth.block.compile()


def parallelize(
    model: nn.Module,
    *,
    tp_mesh: DeviceMesh | None,
    dp_mesh: DeviceMesh | None,
    precision: Precision,
    activation_checkpointing: ActivationCheckpointing,
    compile_blocks: bool,
    param_dtype: Precision = Precision.FP32,
    ep_mesh: DeviceMesh | None = None,
    experts_mesh: DeviceMesh | None = None,
    cp_mesh: DeviceMesh | None = None,
    float8: Float8Recipe = Float8Recipe.OFF,
    emulate_float8: bool = True,
    float8_all_gather: bool = False,
) -> nn.Module:
    """The fixed order: FP8 layers, TP, EP, activation checkpointing, FSDP2, compile. Returns
    the model.
    ``ep_mesh`` and ``experts_mesh``: ``expert_meshes``'s; ``cp_mesh``: the context-parallel
    group the attention layers gather keys and values over (``apply_context_parallel``);
    ``float8``: ``train.float8`` (``emulate_float8``: off a GPU, ``forge.parallel.float8``;
    ``float8_all_gather``: FSDP2 gathers their weights in FP8, ``gathers_in_float8``)."""
    apply_context_parallel(model, cp_mesh)
    # FP8 layers before TP, whose plan then splits them (a swapped module loses its hooks)
    apply_float8(model, float8, emulate_float8, all_gather=float8_all_gather)
    if tp_mesh is not None:
        apply_tp(decoder_of(model), tp_mesh)
    experts = apply_ep(model, ep_mesh) if ep_mesh is not None else set()
    apply_activation_checkpointing(model, activation_checkpointing)
    if dp_mesh is not None:
        ignored = experts if experts_mesh is None else set()
        apply_fsdp(model, dp_mesh, precision, param_dtype, experts_mesh, ignored)
        if float8_all_gather:
            scales_before_forward(model)
    if compile_blocks:
        apply_compile(model)
    return model
