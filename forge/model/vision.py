"""Image encoders and the adapter to the decoder's width.

Images arrive as ``uint8`` ``(B, H, W, 3)`` (as the data holds them) and leave as image
tokens ``(B, N, width)``. ``VisionTransformer`` is forge's own small ViT (pre-norm blocks,
bidirectional attention, learned positions); ``HFVisionTower`` wraps a Hugging Face
``SiglipVisionModel`` or ``CLIPVisionModel`` read from a local folder (the ``transformers``
extra). Parameter names are checkpoint keys: ``patch_embed``, ``pos_embed``,
``blocks.<i>.{norm1,qkv,proj,norm2,fc1,fc2}``, ``norm``; the adapter's ``fc1``, ``fc2``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from forge.config.vision import VisionConfig, VisionEncoderKind
from forge.errors import UserInputError

HF_TOWERS = {"siglip_vision_model": "SiglipVisionModel", "clip_vision_model": "CLIPVisionModel"}


def pixels(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``uint8`` images ``(B, H, W, 3)`` as floats in [-1, 1] of ``dtype``."""
    return (images.to(dtype) / 127.5) - 1.0


class VisionBlock(nn.Module):
    """A pre-norm ViT block: bidirectional multi-head attention, then a GELU MLP."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, n, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, heads, N, head_dim)
        attended = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        x = x + self.proj(attended.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class VisionTransformer(nn.Module):
    """Patches of ``patch_size`` squares, linearly embedded, plus a learned position each,
    through ``n_layers`` blocks and a final LayerNorm: one image token per patch."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.out_dim = cfg.dim
        self.num_tokens = cfg.num_patches
        self.patch_embed = nn.Linear(3 * cfg.patch_size**2, cfg.dim)
        self.pos_embed = nn.Parameter(torch.zeros(cfg.num_patches, cfg.dim))
        self.blocks = nn.ModuleDict(
            {str(i): VisionBlock(cfg.dim, cfg.n_heads) for i in range(cfg.n_layers)}
        )
        self.norm = nn.LayerNorm(cfg.dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, h, w, c = images.shape
        p = self.patch_size
        x = pixels(images, self.pos_embed.dtype)
        patches = x.view(b, h // p, p, w // p, p, c).permute(0, 1, 3, 2, 4, 5)
        x = self.patch_embed(patches.reshape(b, (h // p) * (w // p), p * p * c)) + self.pos_embed
        for block in self.blocks.values():
            x = block(x)
        return self.norm(x)


def hf_vision_config(path: pathlib.Path) -> Any:
    """The vision config in a local Hugging Face folder (a full SigLIP / CLIP config's
    ``vision_config`` too); ``UserInputError`` naming the key when it cannot be used."""
    try:
        import transformers
    except ImportError:
        raise UserInputError(
            [
                "model.vision.encoder: 'hf' needs transformers; pip install -e "
                "'.[transformers]' (or use encoder='vit')"
            ]
        ) from None
    if not (path / "config.json").is_file():
        raise UserInputError(
            [
                f"model.vision.path: {path} holds no config.json; save the tower there "
                "with save_pretrained"
            ]
        )
    config = transformers.AutoConfig.from_pretrained(path)
    config = getattr(config, "vision_config", config)
    if config.model_type not in HF_TOWERS:
        raise UserInputError(
            [
                f"model.vision.path: {path} holds a {config.model_type!r} model; forge reads "
                f"{' or '.join(HF_TOWERS.values())}"
            ]
        )
    return config


class HFVisionTower(nn.Module):
    """A Hugging Face SigLIP or CLIP vision tower: images resized to its own size,
    normalised with its processor's mean and std, its last hidden states out. Built empty
    (``model``); ``pretrained_state`` reads the folder's weights."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.path = pathlib.Path(cfg.path)
        config = hf_vision_config(self.path)  # first: names a missing transformers in one line
        import transformers

        self.model = getattr(transformers, HF_TOWERS[config.model_type])(config)
        self.image_size = int(config.image_size)
        self.out_dim = int(config.hidden_size)
        side = self.image_size // int(config.patch_size)
        self.num_tokens = side * side + (1 if config.model_type == "clip_vision_model" else 0)
        mean, std = processor_stats(self.path)
        self.mean: torch.Tensor
        self.std: torch.Tensor
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        dtype = next(self.model.parameters()).dtype
        x = images.permute(0, 3, 1, 2).to(dtype) / 255.0
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            size = (self.image_size, self.image_size)
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
        x = (x - self.mean.to(dtype)) / self.std.to(dtype)
        return self.model(pixel_values=x).last_hidden_state

    def pretrained_state(self) -> dict[str, torch.Tensor]:
        """The folder's weights and buffers (its position ids too, which ``to_empty`` leaves
        undefined) by this module's names (``model.…``)."""
        import transformers

        cls = getattr(transformers, type(self.model).__name__)
        loaded = cls.from_pretrained(self.path, config=self.model.config)
        tensors = {**dict(loaded.named_buffers()), **dict(loaded.named_parameters())}
        return {f"model.{k}": v.detach() for k, v in tensors.items()}

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The normalisation constants and the tower's position ids again (after ``to_empty``
        from the meta device: neither is in a checkpoint, both are non-persistent)."""
        mean, std = processor_stats(self.path)
        self.mean.copy_(torch.tensor(mean).view(1, 3, 1, 1))
        self.std.copy_(torch.tensor(std).view(1, 3, 1, 1))
        for name, buffer in self.model.named_buffers():
            if name.endswith("position_ids"):  # SigLIP's and CLIP's: 0 .. positions - 1
                positions = torch.arange(buffer.shape[-1], device=buffer.device)
                buffer.copy_(positions.expand_as(buffer))


def processor_stats(path: pathlib.Path) -> tuple[list[float], list[float]]:
    """The image mean and std of the folder's ``preprocessor_config.json`` (0.5 each, as
    SigLIP's, when there is none)."""
    file = path / "preprocessor_config.json"
    if file.is_file():
        raw = json.loads(file.read_text())
        return [float(x) for x in raw["image_mean"]], [float(x) for x in raw["image_std"]]
    return [0.5] * 3, [0.5] * 3


def build_encoder(cfg: VisionConfig) -> VisionTransformer | HFVisionTower:
    """The image encoder ``cfg.encoder`` names."""
    if cfg.encoder is VisionEncoderKind.HF:
        return HFVisionTower(cfg)
    return VisionTransformer(cfg)


class Adapter(nn.Module):
    """A two-layer GELU MLP from the encoder's width to the decoder's."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))
