"""Per-rank memory of a config under a layout, estimated without allocating anything.

The estimate adds what a training rank holds at its peak (``MemoryPlan``):

- **weights, gradients, optimizer state**: the parameters this rank owns — a pipeline stage's
  share (the largest stage), split by tensor parallelism and sharded by FSDP over
  ``dp_shard`` — in ``train.param_dtype``; optimizer state per parameter by optimizer
  (AdamW and Schedule-Free two tensors, Lion one, Muon one for hidden matrices and two for
  the rest);
- **gathered weights**: FSDP2 all-gathers a block to compute it, and prefetches the next one:
  two blocks in the compute dtype (replicas alone too: FSDP2 copies a shard of one rank out
  to compute with it, as it would gather it);
- **activations**: what backward keeps per token and block, counted for this model with SDPA
  attention (no ``T × T`` scores kept), in the compute dtype: ``7·dim`` around the attention
  and the feed-forward (the norms' inputs and outputs, the residual stream), the attention's
  own and the feed-forward's own (``block_elements``). A block of the default shapes,
  grouped-query and dense, keeps ``10·dim + 4·kv_dim + 4·ffn``; latent attention and a
  mixture of experts keep their own tensors. Sequence parallelism divides them by ``tp``
  (latent attention's compressions excepted: every rank computes them whole); full
  activation checkpointing keeps only each block's input plus the largest block's activations
  during its recompute, selective keeps half the blocks; a stage's blocks are the largest
  ones where blocks differ (an upper bound, as for the weights); a pipeline stage keeps as
  many micro-batches in flight as its schedule does (1F1B: up to ``pp``; GPipe: all);
- **loss**: the chunked loss's few ``chunk × vocab`` fp32 buffers, or the plain loss's three
  ``tokens × vocab`` ones;
- **buffers**: the RoPE tables, cos and sin of ``max_seq_len × head_dim / 2`` in fp32 (the
  MoE layers' row selectors, a few bytes each, are left out).
- **FP8 casts** (``train.float8``): the largest FP8 layer's transient casts, a byte an element
  (``float8_bytes``); torchao keeps the high-precision input and weight for backward, so the
  activations are those without FP8. Where FSDP2 gathers the FP8 weights in FP8
  (``gathers_in_float8``), a gathered block counts its FP8 weights at a byte each.

It leaves out the CUDA context, allocator fragmentation and communication buffers: the fit
check keeps ``HEADROOM`` of the device free for them.
"""

from __future__ import annotations

import math

import attrs

from forge.config.model import ModelConfig
from forge.config.sections import (
    ActivationCheckpointing,
    Float8Recipe,
    JobConfig,
    NonFinitePolicy,
    OptimizerName,
    PipelineSchedule,
    Precision,
    SpikePolicy,
)
from forge.config.shapes import block_shapes, forge_shapes, mtp_shapes
from forge.metrics.flops import largest_block_parameters
from forge.parallel.float8 import float8_layers, gathers_in_float8
from forge.parallel.stages import V_SHAPED
from forge.parallel.world import MeshDims

HEADROOM = 0.1  # of the device's memory, for what the estimate leaves out
GIB = 2**30


@attrs.frozen
class MemoryPlan:
    """One rank's estimated peak, in bytes, by part."""

    parameters: int
    gradients: int
    optimizer_state: int
    gathered_weights: int
    activations: int
    activations_without_ac: int  # the same micro-batch with activation checkpointing off
    loss: int
    buffers: int = 0
    # the optimizer step's temporaries: one tensor the size of the parameters (AdamW's foreach
    # step makes a denominator per parameter; Lion and Muon an update each)
    optimizer_step: int = 0
    # train.float8: the largest FP8 layer's transient casts (float8_bytes)
    float8_casts: int = 0
    # host memory, not the device's: the rollback slot (CPU clones of the weights and the
    # optimizer state) when resilience.on_nonfinite or on_spike is "rollback"
    snapshot: int = 0

    @property
    def total(self) -> int:
        """The device's peak (the host's ``snapshot`` aside), every part summed: the optimizer
        step's temporaries counted beside the activations freed before it (an upper bound
        where the allocator reuses that memory; measured, the sum is the closer one on a
        CPU: tests/integration/test_memory_measured.py)."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer_state
            + self.optimizer_step
            + self.gathered_weights
            + self.activations
            + self.loss
            + self.buffers
            + self.float8_casts
        )

    def fits(self, device_bytes: float) -> bool:
        """Whether the total leaves ``HEADROOM`` of the device free."""
        return self.total <= (1 - HEADROOM) * device_bytes


def dtype_bytes(precision: Precision) -> int:
    return 2 if precision is Precision.BF16 else 4


@attrs.frozen
class VisionFootprint:
    """What a vision-language model adds to its decoder: the parameters of its encoder,
    adapter and cross-attention layers, and the image tokens the decoder runs beside each
    caption (the joint decoder's; 0 for cross-attention)."""

    parameters: int = 0
    decoder_tokens: int = 0


TEXT_ONLY = VisionFootprint()


def stage_parameters(
    config: JobConfig, pp: int, vision: VisionFootprint = TEXT_ONLY
) -> tuple[int, int]:
    """(parameters of the largest pipeline stage, of which in 2-D hidden matrices)."""
    m = config.model
    layers = -(-m.n_layers // pp)  # earlier stages take the remainder
    embedding = m.vocab_size * m.dim
    # one stage, or a V layout (rank 0 holds the first and the last stage): embedding, head
    # and norm; else the first stage's embedding or the last's head
    both_ends = pp == 1 or config.distributed.pp_schedule in V_SHAPED
    ends = embedding * (1 if m.tie_embeddings else 2) if both_ends else embedding
    if m.mtp_depth and pp > 1:  # the depths' stage, the last, keeps a copy of the embedding
        ends += embedding
    ends += m.dim
    norms = 2 * m.dim + (2 * m.head_size if m.qk_norm else 0)
    block = largest_block_parameters(m)  # an upper bound where blocks differ (MoE)
    extra = vision.parameters  # a vision-language model is one stage
    # multi-token depths (on the last stage; counted with the largest: an upper bound); their
    # matrices: projection, block
    depths = sum(math.prod(shape) for shape in mtp_shapes(m).values())
    depth_matrices = sum(math.prod(s) for s in mtp_shapes(m).values() if len(s) == 2)
    return layers * block + ends + extra + depths, layers * (block - norms) + extra + depth_matrices


def optimizer_tensors(name: OptimizerName, total: int, hidden_matrices: int) -> float:
    """Optimizer-state elements per the optimizer (a sum over parameters)."""
    if name is OptimizerName.LION:
        return float(total)
    if name is OptimizerName.MUON:  # momentum for hidden matrices, AdamW's two for the rest
        return hidden_matrices + 2.0 * (total - hidden_matrices)
    return 2.0 * total  # AdamW, Schedule-Free AdamW


def attention_elements(m: ModelConfig) -> int:
    """What backward keeps of one block's attention per token, in elements.

    Grouped-query: the queries before and after RoPE (``2·dim``), the keys and values before
    and after (``4·kv_dim``), the output (``dim``). Latent attention, counted by the same rule
    (a projection's output and what RoPE or a norm makes of it): the queries of ``n_heads ×
    qk_dim`` before and after RoPE, the ``q_rank`` bottleneck before and after its norm, the
    latent with the rotated key before and after theirs (``2 × (kv_rank + rope_dim)``), the
    latent's expansion to each head's unrotated key and value (``n_heads × (nope_dim +
    v_dim)``), the keys joined with the shared rotated key (``n_heads × qk_dim``) and the output
    (``n_heads × v_dim``). Its heads are wider than ``dim``: DeepSeek-V3's queries are 128 × 192
    = 24,576 channels a token, 3.4 × its ``dim`` of 7168, where GQA's would be ``dim``."""
    if m.mla is None:
        return 3 * m.dim + 4 * m.kv_heads * m.head_size
    a, heads = m.mla, m.n_heads
    queries = 2 * heads * a.qk_dim + 2 * a.q_rank
    latent = 2 * a.cached_dim
    keys_values = heads * (a.nope_dim + a.v_dim) + heads * a.qk_dim
    return queries + latent + keys_values + heads * a.v_dim


def feed_forward_elements(m: ModelConfig, moe: bool) -> int:
    """What backward keeps of one block's feed-forward per token, in elements: SwiGLU's four
    ``ffn``-wide tensors (its input is a norm's output, counted with the block); a mixture of
    experts' router logits and scores, then for each of the ``top_k`` copies of the token its
    gathered row, its expert's four SwiGLU tensors and its output, and the shared experts'
    SwiGLU (one of ``moe_shared_experts × expert_hidden_dim``)."""
    if not moe:
        return 4 * m.hidden_dim
    width = m.expert_hidden_dim
    routed = m.moe_top_k * (2 * m.dim + 4 * width)
    return 2 * m.moe_num_experts + routed + 4 * m.moe_shared_experts * width


def block_elements(m: ModelConfig, layer: int) -> int:
    """What backward keeps of block ``layer`` per token (``n_layers + k - 1``: multi-token
    depth k's, a mixture of experts where ``mtp_moe``), in elements."""
    return 7 * m.dim + attention_elements(m) + feed_forward_elements(m, m.is_moe_layer(layer))


def replicated_elements(m: ModelConfig) -> int:
    """Of a block's elements, those every tensor-parallel rank keeps whole: latent attention's
    compressions (the latent and rotated key, the query bottleneck, before and after their
    norms) run on every rank with replicated weights, only the heads after them are split."""
    return 0 if m.mla is None else 2 * m.mla.cached_dim + 2 * m.mla.q_rank


def activation_bytes_per_layer(config: JobConfig, tokens: int, tp: int, layer: int = 0) -> int:
    """What backward keeps of block ``layer`` for ``tokens`` tokens (see the module docstring)."""
    whole = replicated_elements(config.model)
    split = block_elements(config.model, layer) - whole
    size = dtype_bytes(config.train.mixed_precision)
    return tokens * split * size // tp + tokens * whole * size


def buffer_bytes(config: JobConfig) -> int:
    """The RoPE tables every rank keeps whole: cos and sin, ``max_seq_len × head_dim / 2``."""
    m = config.model
    return 2 * m.max_seq_len * (m.head_size // 2) * 4


def float8_bytes(config: JobConfig, tokens: int, tp: int) -> int:
    """``train.float8``'s transient casts at their peak, a byte an element: the largest FP8
    layer's (``float8_layers``) in backward, where its output gradient, its input and its
    weight are cast again (transposed) for the two products — in forward only the input and
    the weight are. Split by ``tp`` as the layer is; 0 when off."""
    m = config.model
    if config.train.float8 is Float8Recipe.OFF:
        return 0
    shapes = forge_shapes(m) | mtp_shapes(m)
    casts = [
        tokens * (out + inn) + out * inn
        for out, inn in (shapes[f"{name}.weight"] for name in float8_layers(m).converted)
    ]
    return max(casts, default=0) // tp


def root_parameters(m: ModelConfig) -> int:
    """The parameters FSDP2's root unit holds: the embedding, the output head (unless tied)
    and the final norm."""
    return m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim


def gathered_block_bytes(config: JobConfig, compute_bytes: int, in_float8: bool) -> int:
    """The largest block's weights as FSDP2 gathers them: in the compute dtype, its FP8
    layers' at a byte each where they are gathered in FP8 (``in_float8``)."""
    m = config.model
    if not in_float8:
        return largest_block_parameters(m) * compute_bytes
    converted = set(float8_layers(m).converted)
    sizes = []
    for layer in range(m.n_layers):
        total = 0
        for name, shape in block_shapes(m, layer).items():
            fp8 = f"layers.{layer}.{name.removesuffix('.weight')}" in converted
            total += math.prod(shape) * (1 if fp8 else compute_bytes)
        sizes.append(total)
    return max(sizes)


def context_parallel_bytes(config: JobConfig, cp: int, tp: int = 1) -> tuple[int, int]:
    """What ``distributed.cp > 1`` adds on a rank: per layer, the all-gathered keys and
    values of the whole sequence (this rank's ``1 / tp`` of the KV heads, kept for the
    backward); once per micro-batch, the boolean masks of the key blocks, which only packed
    rows or a sliding window have (``forge.model.block_attention``: about ``(2·cp + 1)``
    squares of a ``seq_len / (2·cp)`` chunk, per row when packed). The CPU's blocks: a GPU's
    dense mask for such rows (``T / cp × T`` per layer, once SDPA makes it additive) and a
    call's transient additive mask are not counted."""
    if cp <= 1:
        return 0, 0
    m, t = config.model, config.train
    compute = dtype_bytes(t.mixed_precision)
    kv = t.batch_size * t.seq_len * 2 * (m.kv_heads // tp) * m.head_size * compute
    if not (config.data.pack_documents or m.sliding_window):
        return kv, 0
    rows = t.batch_size if config.data.pack_documents else 1
    chunk = t.seq_len // (2 * cp)
    return kv, rows * (2 * cp + 1) * chunk * chunk


def memory_plan(
    config: JobConfig, dims: MeshDims, vision: VisionFootprint = TEXT_ONLY
) -> MemoryPlan:
    """This config's per-rank peak under the mesh ``dims`` (a pure function: no torch); a
    vision-language model's ``vision`` adds its parameters and the decoder's image tokens
    (the encoder's own activations are left out)."""
    m, t = config.model, config.train
    stage, hidden = stage_parameters(config, dims.pp, vision)
    shard = dims.dp_shard * dims.cp  # FSDP2 shards over dp_shard × cp
    owned = stage / (dims.tp * shard)
    param_bytes = dtype_bytes(t.param_dtype)
    compute_bytes = dtype_bytes(t.mixed_precision)
    gathered = 0
    if shard > 1 or dims.replicas_alone:  # whole shards are copied out all the same
        in_float8 = gathers_in_float8(config, fsdp=True)
        gathered = 2 * gathered_block_bytes(config, compute_bytes, in_float8) // dims.tp
        # the root's own weights (embedding, head, final norm) stay gathered from forward to
        # backward (FSDP2 does not reshard the root after forward), and their whole gradients
        # wait for the last reduce-scatter
        root = root_parameters(m)
        gathered += 2 * root * compute_bytes // dims.tp
    tokens = t.batch_size * (t.seq_len // dims.cp + vision.decoder_tokens)
    layers = -(-m.n_layers // dims.pp)
    kv_gathered, cp_mask = context_parallel_bytes(config, dims.cp, dims.tp)
    # the stage's blocks, largest first: where blocks differ (dense and MoE), the stage is
    # counted as holding the largest ones (an upper bound, as its weights are)
    blocks = sorted(
        (activation_bytes_per_layer(config, tokens, dims.tp, i) + kv_gathered
         for i in range(m.n_layers)),
        reverse=True,
    )[:layers]  # fmt: skip
    depths = [  # a depth's block attends over the gathered keys too under cp
        activation_bytes_per_layer(config, tokens, dims.tp, m.n_layers + k) + kv_gathered
        for k in range(m.mtp_depth)
    ]
    in_flight = 1
    if dims.pp > 1:
        n_micro = t.grad_accum_steps
        schedule = config.distributed.pp_schedule
        in_flight = n_micro if schedule is PipelineSchedule.GPIPE else min(dims.pp, n_micro)
    block_input = tokens * m.dim * compute_bytes // dims.tp
    without_ac = sum(blocks) + sum(depths)
    ac = t.activation_checkpointing
    if ac is ActivationCheckpointing.FULL:  # one block recomputed at a time: the largest
        kept = layers * block_input + max(blocks + depths)
    elif ac is ActivationCheckpointing.SELECTIVE:
        kept = (layers // 2) * block_input + sum(blocks[: layers - layers // 2])
    else:
        kept = sum(blocks)
    # each multi-token depth: one more block (checkpointed with the others) and one more head
    kept += len(depths) * block_input if ac is not ActivationCheckpointing.NONE else sum(depths)
    vocab_rows = m.vocab_size // dims.tp
    labelled = t.batch_size * t.seq_len // dims.cp  # image tokens have no logits
    if t.loss_chunk_size > 0:  # each head pass also keeps the head's gradient, in fp32
        loss = 3 * min(t.loss_chunk_size, labelled) * vocab_rows * 4
        loss += (1 + m.mtp_depth) * vocab_rows * m.dim * 4
    else:  # every depth keeps its own fp32 logits for backward
        loss = 3 * labelled * vocab_rows * 4 + m.mtp_depth * labelled * vocab_rows * 4
    state = optimizer_tensors(config.optimizer.name, stage, hidden) / (dims.tp * shard)
    res = config.resilience
    rollback = res.on_nonfinite is NonFinitePolicy.ROLLBACK or (
        res.spike_threshold > 0 and res.on_spike is SpikePolicy.ROLLBACK
    )
    return MemoryPlan(
        parameters=round(owned * param_bytes),
        gradients=round(owned * param_bytes),
        optimizer_state=round(state * param_bytes),
        optimizer_step=round(owned * param_bytes),
        snapshot=round((owned + state) * param_bytes) if rollback else 0,
        gathered_weights=gathered,
        activations=(kept + cp_mask) * in_flight,  # every micro-batch in flight has its masks
        activations_without_ac=without_ac * in_flight,
        loss=loss,
        buffers=buffer_bytes(config),
        float8_casts=float8_bytes(config, tokens, dims.tp),
    )
