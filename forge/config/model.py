"""``[model]``: the decoder's shape."""

from __future__ import annotations

import enum
import math

import attrs

from forge.config.latent import LatentConfig
from forge.config.ranges import Problem, non_negative, positive
from forge.config.rope import RopeScaling
from forge.config.vision import VisionConfig, VlmArch


class MoeRouter(enum.Enum):
    """How a mixture-of-experts layer scores experts: a softmax over experts (Mixtral), or an
    independent sigmoid per expert (DeepSeek-V3); both weight the chosen top-k by their
    normalised scores."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class AttentionBackend(enum.Enum):
    """``model.attention``: which kernel computes self-attention (docs/configuration.md).
    Every choice computes the same function; they differ in speed, memory and where they run
    (``forge.model.attention.choose_backend`` resolves ``auto`` per device and batch)."""

    AUTO = "auto"
    SDPA = "sdpa"  # scaled_dot_product_attention: causal, per document, or a dense mask
    FLEX = "flex"  # FlexAttention with a block mask (a CPU runs its forward only)
    VARLEN = "varlen"  # torch's varlen_attn (flash attention): CUDA, bf16/fp16 only


@attrs.frozen
class ModelConfig:
    """A Llama-style decoder. ``n_kv_heads`` < ``n_heads`` gives grouped-query attention."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    head_dim: int | None = None  # each head's width; None: dim / n_heads (Qwen3 sets its own)
    vocab_size: int = 259
    ffn_hidden_dim: int | None = None  # None: 8/3 * dim rounded up to `multiple_of`
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # [model.rope_scaling]; None: plain RoPE
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02
    qk_norm: bool = False  # RMSNorm on each head's query and key (OLMo-2 / Qwen-3 style)
    attention: AttentionBackend = AttentionBackend.AUTO
    sliding_window: int = 0  # each query sees its last this-many keys (itself included); 0: off
    # Mixture of experts (docs/moe.md): 0 experts = every block dense
    moe_num_experts: int = 0
    moe_top_k: int = 2  # experts each token goes through
    moe_shared_experts: int = 0  # experts every token goes through, beside the routed ones
    moe_hidden_dim: int | None = None  # each expert's SwiGLU width; None: the dense width
    moe_every: int = 1  # an MoE block every k blocks (after the first dense ones)
    moe_first_dense: int = 0  # dense blocks at the start (DeepSeek-style)
    moe_router: MoeRouter = MoeRouter.SOFTMAX
    moe_capacity_factor: float = 0.0  # 0: dropless; else tokens past capacity are dropped
    moe_aux_loss_weight: float = 0.01  # load-balancing loss (Switch form), summed over layers
    moe_z_loss_weight: float = 0.0  # router z-loss, summed over layers
    moe_bias_update_rate: float = 0.0  # sigmoid router: aux-loss-free balancing (DeepSeek-V3)
    # sigmoid router, group-limited (DeepSeek-V3's n_group / topk_group): the experts split
    # into this many groups, each token chooses within its ``moe_top_groups`` best groups
    moe_num_groups: int = 1
    moe_top_groups: int = 1
    moe_routed_scale: float = 1.0  # the chosen experts' weights × this (routed_scaling_factor)
    # multi-token prediction (docs/training-loop.md#multi-token-prediction): depths after the
    # main model, depth k predicting the token k + 1 places ahead (DeepSeek-V3); 0: off
    mtp_depth: int = 0
    # each depth's block a mixture of experts like the model's (DeepSeek-V3's form; block index
    # n_layers + k - 1 among the MoE layers); false: a dense SwiGLU
    mtp_moe: bool = False
    # Vision-language (docs/vlm.md): None = a text-only decoder
    vlm: VlmArch | None = None
    vision: VisionConfig | None = None  # [model.vision]; None: its defaults when vlm is set
    # [model.mla]: multi-head latent attention (DeepSeek-V2/V3) instead of grouped-query
    mla: LatentConfig | None = None

    @property
    def vision_config(self) -> VisionConfig:
        """``[model.vision]`` as given, or its defaults."""
        return self.vision if self.vision is not None else VisionConfig()

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_size(self) -> int:
        """Each attention head's width: ``head_dim``, or ``dim / n_heads`` when unset. Every
        shape of attention (projections, RoPE tables, KV cache, counts) derives from it."""
        if self.head_dim is not None:
            return self.head_dim
        return self.dim // self.n_heads if self.n_heads > 0 else 0

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        raw = int(8 * self.dim / 3)
        return self.multiple_of * -(-raw // self.multiple_of)

    @property
    def moe(self) -> bool:
        """Whether any block is a mixture of experts."""
        return self.moe_num_experts > 0 and bool(self.moe_layers)

    @property
    def expert_hidden_dim(self) -> int:
        """Each routed (and shared) expert's SwiGLU width."""
        return self.moe_hidden_dim if self.moe_hidden_dim is not None else self.hidden_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` is a mixture of experts: after ``moe_first_dense`` dense
        blocks, every ``moe_every``-th block (the last of each group of ``moe_every``). Block
        ``n_layers + k - 1`` is multi-token depth k's: one where ``mtp_moe``."""
        if self.moe_num_experts <= 0:
            return False
        if layer >= self.n_layers:
            return self.mtp_moe and layer < self.n_layers + self.mtp_depth
        if layer < self.moe_first_dense or self.moe_every < 1:
            return False
        return (layer - self.moe_first_dense + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the mixture-of-experts blocks, in order: the model's, then the
        multi-token depths' (``mtp_moe``)."""
        blocks = self.n_layers + self.mtp_depth
        return tuple(i for i in range(blocks) if self.is_moe_layer(i))

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        p += self.moe_problems()
        p += self.vlm_problems()
        p += self.attention_problems()
        p += self.head_problems()
        p += self.mtp_problems()
        if self.mla is not None:
            p += self.mla.problems()
            if self.vlm is not None:
                p.append(("model.mla", "is not supported with model.vlm yet; drop [model.mla]"))
            if self.qk_norm:
                p.append(
                    (
                        "model.qk_norm",
                        "latent attention normalises its latents itself; set it false",
                    )
                )
            if self.attention is AttentionBackend.VARLEN:  # its values are narrower than q, k
                p.append(("model.attention", "'varlen' is not supported with [model.mla]"))
            for key in ("n_kv_heads", "head_dim"):  # its heads come from its latents
                if getattr(self, key) is not None:
                    p.append(
                        (
                            f"model.{key}",
                            "has no effect with [model.mla] (latent attention's keys and values "
                            "come from its latents, their widths set in [model.mla]); remove it",
                        )
                    )
        if self.rope_scaling is not None:
            p += self.rope_scaling.problems()
        for key in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            positive(p, f"model.{key}", getattr(self, key))
        positive(p, "model.norm_eps", self.norm_eps)
        positive(p, "model.rope_theta", self.rope_theta)
        positive(p, "model.init_std", self.init_std)
        if self.n_kv_heads is not None:
            positive(p, "model.n_kv_heads", self.n_kv_heads)
        if self.ffn_hidden_dim is not None:
            positive(p, "model.ffn_hidden_dim", self.ffn_hidden_dim)
        if self.n_heads > 0 and self.kv_heads > 0 and self.n_heads % self.kv_heads:
            p.append(("model.n_kv_heads", f"must divide model.n_heads={self.n_heads}"))
        return p

    def head_problems(self) -> list[Problem]:
        """The head size: ``head_dim`` when set, else ``dim / n_heads`` (then whole); even
        either way, for RoPE rotates pairs of channels."""
        p: list[Problem] = []
        if self.head_dim is not None:
            positive(p, "model.head_dim", self.head_dim)
            if self.head_dim > 0 and self.head_dim % 2:
                p.append(("model.head_dim", f"must be even for RoPE, got {self.head_dim}"))
        elif self.n_heads > 0 and self.dim % self.n_heads:
            p.append(("model.dim", f"must be divisible by model.n_heads={self.n_heads}"))
        elif self.n_heads > 0 and (self.dim // self.n_heads) % 2:
            p.append(("model.dim", "dim / n_heads (the head size) must be even for RoPE"))
        return p

    def mtp_problems(self) -> list[Problem]:
        """Multi-token prediction: a depth count >= 0, on a text model (not yet a
        vision-language decoder)."""
        p: list[Problem] = []
        non_negative(p, "model.mtp_depth", self.mtp_depth)
        if self.mtp_depth > 0 and self.vlm is not None:
            p.append(("model.mtp_depth", "is not supported with model.vlm yet; set it to 0"))
        if self.mtp_moe and (self.mtp_depth <= 0 or self.moe_num_experts <= 0):
            p.append(
                (
                    "model.mtp_moe",
                    "makes the multi-token depths' blocks mixtures of experts: it needs "
                    "model.mtp_depth > 0 and model.moe_num_experts > 0; set it to false",
                )
            )
        return p

    def vlm_problems(self) -> list[Problem]:
        """The vision-language keys: ``[model.vision]`` only with ``model.vlm``, no experts."""
        if self.vlm is None:
            if self.vision is not None:
                return [
                    (
                        "model.vlm",
                        "[model.vision] is set but model.vlm is not; set model.vlm to "
                        "'joint_decoder' or 'cross_attention', or drop [model.vision]",
                    )
                ]
            return []
        p = self.vision_config.problems()
        if self.moe_num_experts > 0:
            p.append(
                (
                    "model.vlm",
                    "a vision-language model with mixture-of-experts blocks is not supported "
                    "yet; set model.moe_num_experts=0",
                )
            )
        return p

    def attention_problems(self) -> list[Problem]:
        """``model.attention`` and ``model.sliding_window``: a window is a count of keys; a
        vision-language decoder has its own image-prefix mask, computed by SDPA only."""
        p: list[Problem] = []
        non_negative(p, "model.sliding_window", self.sliding_window)
        if self.vlm is None:
            return p
        if self.attention not in (AttentionBackend.AUTO, AttentionBackend.SDPA):
            p.append(
                (
                    "model.attention",
                    f"'{self.attention.value}' is not supported with model.vlm (its decoder "
                    "masks the image prefix with SDPA); set model.attention='auto'",
                )
            )
        if self.sliding_window:
            p.append(
                (
                    "model.sliding_window",
                    "is not supported with model.vlm (its image-prefix mask has no window); "
                    "set it to 0",
                )
            )
        return p

    def group_problems(self) -> list[Problem]:
        """Group-limited routing's keys: whole groups of at least two experts (a group is
        scored by its best two), enough experts in the chosen groups, a sigmoid router."""
        p: list[Problem] = []
        groups, top, experts = self.moe_num_groups, self.moe_top_groups, self.moe_num_experts
        positive(p, "model.moe_num_groups", groups)
        positive(p, "model.moe_top_groups", top)
        scale = self.moe_routed_scale
        if not math.isfinite(scale) or scale <= 0:
            p.append(("model.moe_routed_scale", f"must be a finite number > 0, got {scale}"))
        if p or (groups == 1 and top == 1):
            return p
        if self.moe_router is not MoeRouter.SIGMOID:
            p.append(("model.moe_num_groups", "group-limited routing needs moe_router='sigmoid'"))
        if experts % groups or experts // groups < 2:
            p.append(
                (
                    "model.moe_num_groups",
                    f"must split model.moe_num_experts={experts} into groups of 2 or more "
                    "experts (a group is scored by its best two)",
                )
            )
        elif top > groups:
            p.append(("model.moe_top_groups", f"must be <= model.moe_num_groups={groups}"))
        elif self.moe_top_k > top * (experts // groups):
            p.append(
                (
                    "model.moe_top_k",
                    f"must be <= the experts of the chosen groups ({top} × {experts // groups})",
                )
            )
        return p

    def moe_problems(self) -> list[Problem]:
        """The mixture-of-experts keys' ranges (none apply when ``moe_num_experts`` is 0)."""
        p: list[Problem] = []
        non_negative(p, "model.moe_num_experts", self.moe_num_experts)
        if self.moe_num_experts <= 0:
            return p
        positive(p, "model.moe_top_k", self.moe_top_k)
        if self.moe_top_k > self.moe_num_experts:
            p.append(
                ("model.moe_top_k", f"must be <= model.moe_num_experts={self.moe_num_experts}")
            )
        for key in ("moe_shared_experts", "moe_first_dense"):
            non_negative(p, f"model.{key}", getattr(self, key))
        positive(p, "model.moe_every", self.moe_every)
        if self.moe_hidden_dim is not None:
            positive(p, "model.moe_hidden_dim", self.moe_hidden_dim)
        for key in (
            "moe_capacity_factor",
            "moe_aux_loss_weight",
            "moe_z_loss_weight",
            "moe_bias_update_rate",
        ):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                p.append((f"model.{key}", f"must be a finite number >= 0, got {value}"))
        if self.moe_bias_update_rate > 0 and self.moe_router is not MoeRouter.SIGMOID:
            p.append(
                (
                    "model.moe_bias_update_rate",
                    "aux-loss-free balancing needs model.moe_router='sigmoid' (the bias shifts "
                    "which experts are chosen, not their softmax weights); set it to 0",
                )
            )
        p += self.group_problems()
        main = [i for i in self.moe_layers if i < self.n_layers]
        if self.moe_every >= 1 and self.moe_first_dense >= 0 and not main:
            p.append(
                (
                    "model.moe_first_dense",
                    f"leaves no mixture-of-experts block among model.n_layers={self.n_layers} "
                    f"(moe_every={self.moe_every}); lower it or set model.moe_num_experts=0",
                )
            )
        return p
