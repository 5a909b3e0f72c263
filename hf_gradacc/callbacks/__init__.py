"""Opt-in `TrainerCallback`s, one per file."""

from .base import GradAccCallback
from .grad_norm import GradNormCallback

__all__ = ["GradAccCallback", "GradNormCallback"]
