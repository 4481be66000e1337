"""Vision-language models: an image encoder, an adapter and the decoder, in two
architectures (``model.vlm``, docs/vlm.md).

``joint_decoder``: the adapter's image tokens are prepended to the text and the decoder runs
over both. Attention is *prefix-causal*: image tokens see every image token (an image has no
reading order), text tokens see every image token and the text before them. Logits (and the
loss) cover the text positions only; RoPE positions run on from the image tokens.

``cross_attention`` (Llama-3.2-Vision style): the decoder sees only text; after every
``cross_attention_every``-th block a gated cross-attention layer lets the text attend to the
image tokens. Its two gates start at zero (tanh(0) = 0), so the model starts out as exactly
the text decoder and learns how much of the image to let in.

Parameter names (checkpoint keys, and the module names ``[[freeze]]`` takes):
``vision_encoder.…``, ``adapter.…``, ``decoder.…`` (the text ``Transformer``'s own names
below it) and, for cross-attention, ``cross_attention.<block>.…``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from forge.config.sections import ModelConfig, VlmArch
from forge.model.chunked_loss import LossSpec
from forge.model.feed_forward import FeedForward
from forge.model.init import Region, fill_, initial_value, region_shape, seeded_normal, whole
from forge.model.transformer import RMSNorm, Transformer, canonical_name
from forge.model.vision import Adapter, HFVisionTower, build_encoder

DECODER = "decoder."
VISION_INIT_STD = 0.02


def prefix_causal_mask(n_image: int, n_text: int, device: torch.device) -> torch.Tensor:
    """Boolean ``(L, L)`` with ``L = n_image + n_text``: causal, and image tokens also see
    the image tokens after them."""
    length = n_image + n_text
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    allowed[:n_image, :n_image] = True
    return allowed


class CrossAttentionBlock(nn.Module):
    """Text attends to image tokens (no mask, no RoPE: the image tokens carry their
    positions from the encoder), then a SwiGLU; each residual branch scaled by tanh of a
    gate that starts at zero."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.head_size
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.attn_gate = nn.Parameter(torch.zeros(1))
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)
        self.ffn_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        n = image.shape[1]
        q = self.wq(self.attention_norm(x)).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(image).view(b, n, -1, self.head_dim).transpose(1, 2)
        v = self.wv(image).view(b, n, -1, self.head_dim).transpose(1, 2)
        gqa = self.n_kv_heads != self.n_heads
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        x = x + self.attn_gate.tanh() * self.wo(out.transpose(1, 2).reshape(b, t, -1))
        return x + self.ffn_gate.tanh() * self.feed_forward(self.ffn_norm(x))


def cross_attention_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """The decoder blocks followed by a cross-attention layer: every k-th (the last of each
    group of ``cross_attention_every``)."""
    every = cfg.vision_config.cross_attention_every
    return tuple(i for i in range(cfg.n_layers) if (i + 1) % every == 0)


class VisionLanguageModel(nn.Module):
    """Image encoder → adapter → decoder, joined as ``cfg.vlm`` says (see the module)."""

    cross_attention: nn.ModuleDict | None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.vlm is not None, "a vision-language model needs model.vlm"
        self.cfg = cfg
        vision = cfg.vision_config
        self.vision_encoder = build_encoder(vision)
        hidden = vision.adapter_hidden_dim or cfg.dim
        self.adapter = Adapter(self.vision_encoder.out_dim, hidden, cfg.dim)
        self.decoder = Transformer(cfg)
        self.cross_attention = None
        if cfg.vlm is VlmArch.CROSS_ATTENTION:
            self.cross_attention = nn.ModuleDict(
                {str(i): CrossAttentionBlock(cfg) for i in cross_attention_layers(cfg)}
            )
        if not self.decoder.rope_cos.is_meta:
            self.init_weights()

    @property
    def num_image_tokens(self) -> int:
        """Image tokens per image (what the joint decoder adds to each sequence)."""
        return self.vision_encoder.num_tokens

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """``uint8`` images ``(B, H, W, 3)`` to the adapter's tokens ``(B, N, dim)``."""
        return self.adapter(self.vision_encoder(images))

    def forward(
        self,
        tokens: torch.Tensor,
        images: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        loss: LossSpec | None = None,
    ) -> Any:
        """Caption tokens ``(B, T)`` and their images to logits ``(B, T, vocab)`` over the
        text positions (or, with ``labels`` and a chunked ``loss``, the chunked loss's
        terms, as ``Transformer.forward``)."""
        if images is None:
            raise ValueError("a vision-language model needs images beside the tokens")
        return self.decode(tokens, self.image_tokens(images), labels, loss)

    def decode(
        self,
        tokens: torch.Tensor,
        image: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss: LossSpec | None = None,
    ) -> Any:
        """``forward`` from the adapter's image tokens ``(B, N, dim)`` on."""
        decoder = self.decoder
        assert decoder.tok_embeddings is not None
        h = decoder.tok_embeddings(tokens)
        n_text = tokens.shape[1]
        mask = None
        if self.cross_attention is None:  # joint decoder: image tokens first
            h = torch.cat([image.to(h.dtype), h], dim=1)
            mask = prefix_causal_mask(image.shape[1], n_text, h.device)
        cos, sin = decoder.rope_cos, decoder.rope_sin
        for name, layer in decoder.layers.items():
            h = layer(h, cos, sin, mask)
            if self.cross_attention is not None and name in self.cross_attention:
                h = self.cross_attention[name](h, image)
        return decoder.head(h[:, -n_text:], labels, loss)

    def materialize(self, device: torch.device | str) -> None:
        """Allocate a model built on the meta device (see ``Transformer.materialize``)."""
        self.to_empty(device=device)
        decoder = self.decoder
        if self.cfg.tie_embeddings and decoder.output is not None:
            assert decoder.tok_embeddings is not None
            decoder.output.weight = decoder.tok_embeddings.weight
        decoder.reset_buffers()
        if isinstance(self.vision_encoder, HFVisionTower):
            self.vision_encoder.reset_buffers()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Every parameter from ``vlm_initial_value`` (the decoder's exactly as a text
        model's with the same seed); a Hugging Face tower's from its folder."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        pretrained: dict[str, torch.Tensor] = {}
        if isinstance(self.vision_encoder, HFVisionTower):
            encoder_state = self.vision_encoder.pretrained_state()
            pretrained = {f"vision_encoder.{k}": v for k, v in encoder_state.items()}
        for name, p in self.named_parameters():
            key = canonical_name(name)
            if (full := pretrained.get(key)) is not None:
                fill_(p, functools.partial(part_of, full))
            else:
                fill_(p, functools.partial(vlm_initial_value, key, tuple(p.shape), self.cfg, seed))
        for name, buffer in self.vision_encoder.named_buffers():
            if (value := pretrained.get(f"vision_encoder.{name}")) is not None:
                buffer.copy_(value)  # the tower's own (position ids); buffers are not sharded


def vlm_initial_value(
    name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int, region: Region | None = None
) -> torch.Tensor:
    """``region`` (default: all) of the initial value of a vision-language parameter, a pure
    function of (name, shape, seed): the decoder's as ``initial_value``'s; elsewhere norm
    weights one, biases and gates zero, the rest normal with std 0.02 (the cross-attention
    ``wo`` and ``w2`` scaled by depth as the decoder's)."""
    region = whole(shape) if region is None else region
    if name.startswith(DECODER):
        return initial_value(name[len(DECODER) :], shape, cfg, seed, region)
    module = name.rsplit(".", 2)[-2] if name.count(".") else name
    if name.endswith(".weight") and "norm" in module:
        return torch.ones(region_shape(region))
    if name.endswith((".bias", "_gate")):
        return torch.zeros(region_shape(region))
    if name.startswith("cross_attention."):
        return initial_value(name, shape, cfg, seed, region)
    return seeded_normal(name, shape, VISION_INIT_STD, seed, region)


def part_of(full: torch.Tensor, region: Region) -> torch.Tensor:
    """The ``region`` of a full value (a pretrained tower's weight)."""
    return full[tuple(slice(start, stop) for start, stop in region)]


def build_model(cfg: ModelConfig) -> Transformer | VisionLanguageModel:
    """The model ``[model]`` describes: a vision-language model when ``model.vlm`` is set,
    else the text decoder."""
    return VisionLanguageModel(cfg) if cfg.vlm is not None else Transformer(cfg)


def is_vlm(model: nn.Module) -> bool:
    """Whether ``model`` (possibly FSDP-wrapped) takes images beside its tokens."""
    return isinstance(model, VisionLanguageModel)


def empty_model(
    cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> Transformer | VisionLanguageModel:
    """``build_model``'s model allocated on ``device`` in ``dtype`` and left uninitialised, for
    weights about to be loaded (nothing is initialised only to be overwritten, nor built on
    the CPU first); RoPE tables and other buffers are computed as usual (RoPE's in fp32)."""
    with torch.device("meta"):
        model = build_model(cfg)
    model.to(dtype=dtype)
    model.materialize(device)
    return model
