"""Every tensor of a forge model's state dict with its shape, from its ``ModelConfig`` alone
(no model is built): the one description of a block that the Hugging Face interop checks
files against and the FLOP and memory formulas count. Pure (no torch)."""

from __future__ import annotations

from forge.config.model import ModelConfig

ROUTER_GATE = "feed_forward.router.gate.weight"
ROUTER_BIAS = "feed_forward.router.expert_bias"  # a buffer: 0 under softmax routing
ROUTED_EXPERTS = (  # every expert's weights stacked (E, in, out): a token passes top_k of them
    "feed_forward.experts.w1",
    "feed_forward.experts.w2",
    "feed_forward.experts.w3",
)


def block_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Block ``layer``'s tensors: its norms, attention (and query/key norms), feed-forward."""
    dim, head = cfg.dim, cfg.head_size
    q, kv = cfg.n_heads * head, cfg.kv_heads * head
    block = {
        "attention_norm.weight": (dim,),
        "attention.wq.weight": (q, dim),
        "attention.wk.weight": (kv, dim),
        "attention.wv.weight": (kv, dim),
        "attention.wo.weight": (dim, q),
    }
    if cfg.mla is not None:
        block = {"attention_norm.weight": (dim,), **latent_attention_shapes(cfg)}
    if cfg.qk_norm:
        block |= {"attention.q_norm.weight": (head,), "attention.k_norm.weight": (head,)}
    block["ffn_norm.weight"] = (dim,)
    return block | feed_forward_shapes(cfg, layer)


def latent_attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Latent attention's tensors (``forge.model.latent_attention``)."""
    m, dim, heads = cfg.mla, cfg.dim, cfg.n_heads
    assert m is not None
    if m.q_rank > 0:
        shapes = {
            "attention.wq_a.weight": (m.q_rank, dim),
            "attention.q_a_norm.weight": (m.q_rank,),
            "attention.wq_b.weight": (heads * m.qk_dim, m.q_rank),
        }
    else:
        shapes = {"attention.wq.weight": (heads * m.qk_dim, dim)}
    return shapes | {
        "attention.wkv_a.weight": (m.kv_rank + m.rope_dim, dim),
        "attention.kv_norm.weight": (m.kv_rank,),
        "attention.wkv_b.weight": (heads * (m.nope_dim + m.v_dim), m.kv_rank),
        "attention.wo.weight": (dim, heads * m.v_dim),
    }


def feed_forward_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Block ``layer``'s feed-forward tensors: a SwiGLU's, or a router's and the experts'."""
    dim = cfg.dim
    if not cfg.is_moe_layer(layer):
        hidden = cfg.hidden_dim
        return {
            "feed_forward.w1.weight": (hidden, dim),
            "feed_forward.w2.weight": (dim, hidden),
            "feed_forward.w3.weight": (hidden, dim),
        }
    experts, hidden = cfg.moe_num_experts, cfg.expert_hidden_dim
    shapes = {
        ROUTER_GATE: (experts, dim),
        ROUTER_BIAS: (experts,),
        "feed_forward.experts.w1": (experts, dim, hidden),
        "feed_forward.experts.w2": (experts, hidden, dim),
        "feed_forward.experts.w3": (experts, dim, hidden),
    }
    if cfg.moe_shared_experts:
        shared = cfg.moe_shared_experts * hidden
        shapes |= {
            "feed_forward.shared.w1.weight": (shared, dim),
            "feed_forward.shared.w2.weight": (dim, shared),
            "feed_forward.shared.w3.weight": (shared, dim),
        }
    return shapes


def forge_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``cfg``'s state dict with its shape, in the model's order."""
    dim = cfg.dim
    shapes = {"tok_embeddings.weight": (cfg.vocab_size, dim)}
    for i in range(cfg.n_layers):
        shapes |= {f"layers.{i}.{name}": shape for name, shape in block_shapes(cfg, i).items()}
    return shapes | {"norm.weight": (dim,), "output.weight": (cfg.vocab_size, dim)}


def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The multi-token depths' tensors (``model.mtp_depth``; ``forge.model.mtp``): per depth
    two norms, the projection of the joined states, a block (block ``n_layers + k - 1``: dense,
    or a mixture of experts with ``model.mtp_moe``) and the final norm."""
    dim = cfg.dim
    shapes: dict[str, tuple[int, ...]] = {}
    for k in range(1, cfg.mtp_depth + 1):
        shapes |= {
            f"mtp.{k}.hidden_norm.weight": (dim,),
            f"mtp.{k}.embed_norm.weight": (dim,),
            f"mtp.{k}.proj.weight": (dim, 2 * dim),
        }
        block = block_shapes(cfg, cfg.n_layers + k - 1)
        shapes |= {f"mtp.{k}.block.{n}": shape for n, shape in block.items()}
        shapes[f"mtp.{k}.norm.weight"] = (dim,)
    return shapes
