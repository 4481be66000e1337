"""One micro-batch as the training step takes it: token rows, their labels, and what packing,
mixtures, phases and images add to them."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class Batch:
    """One micro-batch: ``labels`` is ``inputs`` shifted left by one token.

    Packed batches also carry per-token ``positions`` and ``document_ids`` (and labels that
    would cross a document boundary are masked). ``sources`` is each row's source index;
    ``lr_scale`` the active data phase's LR multiplier. An image–caption batch carries each
    row's image, ``uint8`` ``(B, H, W, 3)``.
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    sources: torch.Tensor | None = None
    lr_scale: float = 1.0
    images: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.labels.numel()

    @property
    def num_images(self) -> int:
        return 0 if self.images is None else self.images.shape[0]

    def pin_memory(self) -> Batch:
        """The same batch in page-locked host memory (as ``DataLoader(pin_memory=True)`` asks
        of what it yields), so that the copy to a GPU is asynchronous."""
        pinned = {
            f.name: v.pin_memory()
            for f in attrs.fields(Batch)
            if isinstance(v := getattr(self, f.name), torch.Tensor)
        }
        return attrs.evolve(self, **pinned)

    def to(self, device: torch.device) -> Batch:
        """The same batch with every tensor on ``device`` (asynchronously, from pinned
        memory)."""
        if device.type == "cpu":
            return self
        move = {
            f.name: v.to(device, non_blocking=True)
            for f in attrs.fields(Batch)
            if isinstance(v := getattr(self, f.name), torch.Tensor)
        }
        return attrs.evolve(self, **move)
