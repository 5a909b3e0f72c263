"""A training problem whose gradient noise scale is known exactly, for `GradientNoiseScaleCallback`.

The model scores a sample ``x`` (``dim`` values) as ``c . (W x + bias)`` with a fixed unit vector ``c`` and the loss
of a sample IS its score, so a sample's gradient is ``(c x^T, c)`` whatever ``W`` and ``bias`` are: its mean and its
covariance are set by the data alone and stay put while the model trains. With ``x ~ N(m 1, s^2 I)``:

    |G|^2 = |c|^2 (|m 1|^2 + 1) = dim m^2 + 1          tr(S) = |c|^2 tr(Cov x) = dim s^2

so ``B_simple = dim s^2 / (dim m^2 + 1)`` samples (:attr:`NoiseProblem.noise_scale`).

Example:
    ```python
    problem = NoiseProblem.with_noise_scale(16.0)
    trainer = ScoreSumTrainer(model=problem.model(), args=args, train_dataset=problem.dataset(512, seed=0),
                              callbacks=[GradientNoiseScaleCallback()])
    ```
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..loss import LossTerm
from ..trainer import GradAccTrainer


class LinearScoreModel(nn.Module):
    """``score = c . (W x + bias)`` per sample; ``forward`` returns ``{"score": [rows]}`` (a dict, as a
    ModelOutput)."""

    def __init__(self, dim: int, outputs: int = 2, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.linear = nn.Linear(dim, outputs)
        with torch.no_grad():
            self.linear.weight.copy_(0.1 * torch.randn(outputs, dim, generator=generator))
            self.linear.bias.zero_()
        direction = torch.randn(outputs, generator=generator)
        self.register_buffer("direction", direction / direction.norm())

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"score": self.linear(x) @ self.direction}


class ScoreSumTrainer(GradAccTrainer):
    """The loss of a micro-batch is the SUM of its samples' scores, normalised by the step's samples."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        term = LossTerm(outputs["score"].sum(), "samples")
        return (term, outputs) if return_outputs else term


class GaussianSamples(torch.utils.data.Dataset):
    """``num_samples`` rows ``{"x": N(mean 1, std^2 I)}`` drawn once from ``seed``."""

    def __init__(self, num_samples: int, dim: int, mean: float, std: float, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = mean + std * torch.randn(num_samples, dim, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i]}


@dataclass(frozen=True, slots=True, kw_only=True)
class NoiseProblem:
    """The data's mean ``mean`` and standard deviation ``std`` per input value, and the exact values they give."""

    dim: int = 256
    outputs: int = 2
    mean: float = 0.25
    std: float = 1.0

    @classmethod
    def with_noise_scale(cls, noise_scale: float, *, dim: int = 256, mean: float = 0.25) -> NoiseProblem:
        """The problem whose ``B_simple`` is ``noise_scale`` samples."""
        return cls(dim=dim, mean=mean, std=math.sqrt(noise_scale * (dim * mean * mean + 1.0) / dim))

    @property
    def grad_sq(self) -> float:
        """``|G|^2`` of the mean gradient."""
        return self.dim * self.mean * self.mean + 1.0

    @property
    def trace(self) -> float:
        """``tr(S)`` of the per-sample gradient covariance."""
        return self.dim * self.std * self.std

    @property
    def noise_scale(self) -> float:
        """``B_simple = tr(S) / |G|^2``, in samples."""
        return self.trace / self.grad_sq

    def model(self, seed: int = 0) -> LinearScoreModel:
        return LinearScoreModel(self.dim, self.outputs, seed=seed)

    def dataset(self, num_samples: int, seed: int = 0) -> GaussianSamples:
        return GaussianSamples(num_samples, self.dim, self.mean, self.std, seed=seed)


def mean_gradient_sq_norm(model: nn.Module, x: torch.Tensor) -> float:
    """``|mean_i grad loss_i|^2`` over the rows of ``x``, in float64 on a copy of ``model`` (a reference that shares
    no code with the trainer)."""
    reference = copy.deepcopy(model).double()
    reference.zero_grad()
    reference(x.double())["score"].mean().backward()
    return float(sum(p.grad.pow(2).sum() for p in reference.parameters() if p.grad is not None))
