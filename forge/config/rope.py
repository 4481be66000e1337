"""``[model.rope_scaling]``: RoPE's frequencies rescaled for a context longer than the one
the model was first trained at (docs/configuration.md)."""

from __future__ import annotations

import enum

import attrs

from forge.config.ranges import Problem, positive


class RopeScalingType(enum.Enum):
    """How the rotary frequencies are rescaled. ``llama3``: Llama 3.1's — wavelengths longer
    than ``original_max_seq_len / low_freq_factor`` slowed by ``factor``, those shorter than
    ``original_max_seq_len / high_freq_factor`` kept, the band between interpolated smoothly
    (transformers' ``_compute_llama3_parameters``)."""

    LLAMA3 = "llama3"


@attrs.frozen
class RopeScaling:
    """``[model.rope_scaling]``; the defaults are Llama 3.1's (Llama 3.2 uses ``factor`` 32)."""

    type: RopeScalingType = RopeScalingType.LLAMA3
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192  # the context the unscaled model was trained at

    def problems(self) -> list[Problem]:
        """Each key's range: a factor that slows (>= 1), a band of positive width."""
        p: list[Problem] = []
        if self.factor < 1:
            p.append(
                (
                    "model.rope_scaling.factor",
                    f"must be >= 1 (it divides the low frequencies), got {self.factor}",
                )
            )
        positive(p, "model.rope_scaling.low_freq_factor", self.low_freq_factor)
        if self.high_freq_factor <= self.low_freq_factor:
            p.append(
                (
                    "model.rope_scaling.high_freq_factor",
                    f"must be > model.rope_scaling.low_freq_factor={self.low_freq_factor} "
                    f"(the band between them is interpolated), got {self.high_freq_factor}",
                )
            )
        positive(p, "model.rope_scaling.original_max_seq_len", self.original_max_seq_len)
        return p
