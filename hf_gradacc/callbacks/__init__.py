"""Opt-in `TrainerCallback`s, one per file."""

from .batchnorm import BatchNormCallback
from .callback import GradAccCallback
from .grad_norm import GradNormCallback
from .noise_scale import GradientNoiseScaleCallback, NoiseScaleStep, noise_scale_estimates
from .token_stats import TokenStatsCallback

__all__ = [
    "BatchNormCallback",
    "GradAccCallback",
    "GradNormCallback",
    "GradientNoiseScaleCallback",
    "NoiseScaleStep",
    "TokenStatsCallback",
    "noise_scale_estimates",
]
