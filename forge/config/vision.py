"""``model.vlm`` and ``[model.vision]``: a vision-language model's architecture and its image
encoder (docs/vlm.md)."""

from __future__ import annotations

import enum

import attrs

from forge.config.ranges import Problem, positive, usable_path


class VlmArch(enum.Enum):
    """How image features reach the decoder: prepended to the text as tokens
    (``joint_decoder``), or through gated cross-attention layers every
    ``cross_attention_every`` blocks (``cross_attention``, Llama-3.2-Vision style)."""

    JOINT_DECODER = "joint_decoder"
    CROSS_ATTENTION = "cross_attention"


class VisionEncoderKind(enum.Enum):
    """The image encoder: forge's own small ViT trained from scratch (``vit``), or a Hugging
    Face ``SiglipVisionModel`` / ``CLIPVisionModel`` loaded from a local folder (``hf``)."""

    VIT = "vit"
    HF = "hf"


@attrs.frozen
class VisionConfig:
    """``[model.vision]``: the image encoder and the adapter to the decoder's width.

    ``image_size`` is the side of the square RGB images the data holds; the built-in ViT cuts
    them into ``patch_size`` squares, one image token each. An ``hf`` encoder takes its own
    width, depth and patch size from the folder's ``config.json`` (the ``dim`` / ``n_layers``
    / ``n_heads`` / ``patch_size`` keys are then unused) and resizes images to its own size.
    """

    encoder: VisionEncoderKind = VisionEncoderKind.VIT
    path: str = ""  # encoder = "hf": a local folder written by save_pretrained
    image_size: int = 32
    patch_size: int = 4
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    adapter_hidden_dim: int | None = None  # the adapter MLP's width; None: the decoder's dim
    cross_attention_every: int = 2  # cross_attention: a gated layer after every k-th block

    @property
    def num_patches(self) -> int:
        """Image tokens per image from the built-in ViT."""
        side = self.image_size // self.patch_size if self.patch_size > 0 else 0
        return side * side

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        for key in (
            "image_size",
            "patch_size",
            "dim",
            "n_layers",
            "n_heads",
            "cross_attention_every",
        ):
            positive(p, f"model.vision.{key}", getattr(self, key))
        if self.adapter_hidden_dim is not None:
            positive(p, "model.vision.adapter_hidden_dim", self.adapter_hidden_dim)
        if self.encoder is VisionEncoderKind.HF:
            if not self.path.strip():
                p.append(
                    (
                        "model.vision.path",
                        "encoder='hf' needs a local folder holding a SiglipVisionModel or "
                        "CLIPVisionModel (written by save_pretrained)",
                    )
                )
            usable_path(p, "model.vision.path", self.path)
            return p
        if self.patch_size > 0 and self.image_size % self.patch_size:
            p.append(
                (
                    "model.vision.patch_size",
                    f"must divide model.vision.image_size={self.image_size}",
                )
            )
        if self.n_heads > 0 and self.dim % self.n_heads:
            p.append(
                ("model.vision.dim", f"must be divisible by model.vision.n_heads={self.n_heads}")
            )
        return p
