"""Decoder transformer and sampling."""

from forge.model.transformer import Transformer, num_parameters

__all__ = ["Transformer", "num_parameters"]
