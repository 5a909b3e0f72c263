"""The float64 full-batch reference that exactness is measured against.

It shares no code with the trainer: a deep copy of the initial model in float64, every sample of the optimizer
step (from every rank) in ONE forward pass, and each head family's loss written out by hand (explicit shift,
explicit ignore mask, explicit mean over the full batch). Only torch is used.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Comparison:
    """How far an update is from the reference gradient."""

    relative_error: float
    cosine: float
    norm_ratio: float

    def is_exact(self, tolerance: float = 1e-5) -> bool:
        return self.relative_error <= tolerance


def _row_mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore: int) -> tuple[torch.Tensor, int]:
    logp = torch.log_softmax(logits, dim=-1)
    mask = targets != ignore
    safe = torch.where(mask, targets, torch.zeros_like(targets))
    picked = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return -(picked * mask).sum(), int(mask.sum())


def full_batch_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], task: str, ignore: int = -100):
    """The loss of the whole step as the user means it: a mean over every counted item of the full batch."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if task == "seq2seq":
        start = model.config.decoder_start_token_id
        dec = torch.full_like(labels, start)
        dec[:, 1:] = labels[:, :-1]
        dec = dec.masked_fill(dec == ignore, model.config.pad_token_id)
        inputs["decoder_input_ids"] = dec
    logits = model(**inputs).logits.double()
    if task == "causal_lm":
        total, count = _row_mean_cross_entropy(logits[:, :-1, :], labels[:, 1:], ignore)
        return total / count
    if task in ("seq2seq", "masked_lm", "token_classification"):
        total, count = _row_mean_cross_entropy(logits, labels, ignore)
        return total / count
    if task == "sequence_classification":
        total, count = _row_mean_cross_entropy(logits, labels, ignore)
        return total / count
    if task == "regression":
        return ((logits.reshape(-1) - labels.double().reshape(-1)) ** 2).mean()
    if task == "multi_label_classification":
        y = labels.double()
        # BCE with logits written out: max(x,0) - x*y + log(1 + exp(-|x|))
        per = logits.clamp(min=0) - logits * y + torch.log1p(torch.exp(-logits.abs()))
        return per.mean()
    raise ValueError(f"unknown task {task!r}")


def reference_gradients(
    model: torch.nn.Module,
    samples: Sequence[dict[str, Any]],
    task: str,
    collate: Callable[[Sequence[dict[str, Any]]], dict[str, torch.Tensor]],
    ignore: int = -100,
) -> dict[str, torch.Tensor]:
    """Float64 gradient of the full-batch loss over ``samples``, keyed by parameter name (trainable only)."""
    ref = copy.deepcopy(model).double().eval()
    batch = collate(list(samples))
    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
    ref.zero_grad()
    full_batch_loss(ref, batch, task, ignore).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.requires_grad and p.grad is not None}


def compare(update: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> Comparison:
    """Relative error, cosine and norm ratio of ``update`` against ``reference`` over their shared names."""
    names = [n for n in reference if n in update]
    if not names:
        raise ValueError("no parameter name is shared by the update and the reference")
    u = torch.cat([update[n].double().reshape(-1) for n in names])
    r = torch.cat([reference[n].double().reshape(-1) for n in names])
    rn = r.norm()
    return Comparison(
        relative_error=float((u - r).norm() / rn),
        cosine=float(torch.dot(u, r) / (u.norm() * rn).clamp_min(1e-300)),
        norm_ratio=float(u.norm() / rn),
    )
