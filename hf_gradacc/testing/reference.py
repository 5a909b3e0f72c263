"""The float64 full-batch reference that exactness is measured against.

It shares no code with the trainer: a deep copy of the initial model in float64, every sample of the optimizer
step (from every rank) in ONE forward pass, and each head family's loss written out by hand (explicit shift,
explicit ignore mask, explicit mean over the full batch). Only torch is used.

A mixture-of-experts model's router load-balancing loss is a function of each forward's routing, so its reference
is defined per micro-batch: ``sum_m (routed tokens of m / routed tokens of the step) x coef x aux(m)``, with
``aux(m)`` the model's own loss of micro-batch ``m`` in float64 (eager experts) and routed tokens its
``attention_mask`` ones. The caller passes the micro-batches' samples (``micro_batches``) for that term.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import GradAccConfigError, GradAccUsageError  # noqa: F401


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
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "loss_weights")}
    if "loss_weights" in batch:
        return _weighted_full_batch_loss(model, inputs, labels, batch["loss_weights"].double(), task, ignore)
    if task == "seq2seq":
        start = model.config.decoder_start_token_id
        dec = torch.full_like(labels, start)
        dec[:, 1:] = labels[:, :-1]
        dec = dec.masked_fill(dec == ignore, model.config.pad_token_id)
        inputs["decoder_input_ids"] = dec
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        inputs["output_router_logits"] = False  # the router term has its own, per-micro-batch reference
    logits = model(**inputs).logits.double()
    if task == "causal_lm":
        total, count = _row_mean_cross_entropy(logits[:, :-1, :], labels[:, 1:], ignore)
        return total / count
    if task in ("seq2seq", "masked_lm", "token_classification"):
        total, count = _row_mean_cross_entropy(logits, labels, ignore)
        return total / count
    if task in ("sequence_classification", "image_classification"):  # one label per row: [B, num_labels] vs [B]
        total, count = _row_mean_cross_entropy(logits, labels, ignore)
        return total / count
    if task == "regression":
        return ((logits.reshape(-1) - labels.double().reshape(-1)) ** 2).mean()
    if task == "multi_label_classification":
        y = labels.double()
        # BCE with logits written out: max(x,0) - x*y + log(1 + exp(-|x|))
        per = logits.clamp(min=0) - logits * y + torch.log1p(torch.exp(-logits.abs()))
        return per.mean()
    raise GradAccConfigError(f"unknown task {task!r}")


def _weighted_full_batch_loss(model, inputs, labels, weights, task: str, ignore: int):
    """``sum_i w_i loss_i / sum_i w_i`` over the counted targets of the full batch, written out by hand: a per-sample
    weight ``[B]`` weighs every counted target of its row, a per-token one ``[B, T]`` the label at its own position
    (the causal LM's target ``labels[:, j]``, predicted at ``j - 1``, has the weight ``weights[:, j]``)."""
    logits = model(**inputs).logits.double()
    if task in ("causal_lm", "masked_lm", "token_classification"):
        if weights.dim() == 1:
            weights = weights[:, None].expand(labels.shape)
        if task == "causal_lm":
            logits, labels, weights = logits[:, :-1, :], labels[:, 1:], weights[:, 1:]
        logp = torch.log_softmax(logits, dim=-1)
        counted = labels != ignore
        nll = -logp.gather(-1, torch.where(counted, labels, 0).unsqueeze(-1)).squeeze(-1)
        w = torch.where(counted, weights, torch.zeros_like(weights))
        return (nll * w).sum() / w.sum()
    if task in ("sequence_classification", "image_classification"):
        counted = labels != ignore
        nll = -torch.log_softmax(logits, dim=-1).gather(-1, torch.where(counted, labels, 0)[:, None])[:, 0]
        w = torch.where(counted, weights, torch.zeros_like(weights))
        return (nll * w).sum() / w.sum()
    if task == "regression":
        per_row = (logits.reshape(-1) - labels.double().reshape(-1)) ** 2
        return (per_row * weights).sum() / weights.sum()
    if task == "multi_label_classification":
        y = labels.double()
        per = logits.clamp(min=0) - logits * y + torch.log1p(torch.exp(-logits.abs()))
        return (per.mean(-1) * weights).sum() / weights.sum()
    raise GradAccConfigError(f"no weighted reference for task {task!r}")


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``model`` in eval mode; mixture-of-experts experts switched to the eager implementation
    (their grouped-mm kernel has no float64 CPU version)."""
    ref = copy.deepcopy(model).double().eval()
    config = getattr(ref, "config", None)
    if callable(getattr(ref, "set_experts_implementation", None)) and getattr(config, "_experts_implementation", None):
        ref.set_experts_implementation("eager")
    return ref


def router_coefficient(model: torch.nn.Module) -> float | None:
    """The router load-balancing coefficient the model uses (None: the model returns no such loss)."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    for name in ("router_aux_loss_coef", "aux_loss_coef"):
        value = getattr(model, name, getattr(config, name, None))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def router_loss(model: torch.nn.Module, micro_batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    """``sum_m (routed_m / routed) * coef * aux_m`` over the step's micro-batches (already collated, float64)."""
    coef = router_coefficient(model)
    routed = [int(mb["attention_mask"].sum()) for mb in micro_batches]
    total = torch.zeros((), dtype=torch.float64)
    for mb, n in zip(micro_batches, routed):
        inputs = {k: v for k, v in mb.items() if k != "labels"}
        aux = model(**inputs, output_router_logits=True).aux_loss
        total = total + coef * aux.double() * n / sum(routed)
    return total


def reference_gradients(
    model: torch.nn.Module,
    samples: Sequence[dict[str, Any]],
    task: str,
    collate: Callable[[Sequence[dict[str, Any]]], dict[str, torch.Tensor]],
    ignore: int = -100,
    *,
    micro_batches: Sequence[Sequence[dict[str, Any]]] | None = None,
) -> dict[str, torch.Tensor]:
    """Float64 gradient of the full-batch loss over ``samples``, keyed by parameter name (trainable only).

    ``micro_batches``: the samples of each micro-batch of the step (every rank's), needed only when the model
    returns a router load-balancing loss (then it is required).
    """
    ref = float64_copy(model)
    batch = collate(list(samples))
    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
    ref.zero_grad()
    loss = full_batch_loss(ref, batch, task, ignore)
    if router_coefficient(ref) is not None:
        if micro_batches is None:
            raise GradAccConfigError(
                "the model returns a router loss: pass the step's `micro_batches` to the reference"
            )
        loss = loss + router_loss(ref, [collate(list(mb)) for mb in micro_batches])
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.requires_grad and p.grad is not None}


def two_term_reference(
    model: torch.nn.Module,
    samples: Sequence[dict[str, Any]],
    collate: Callable[[Sequence[dict[str, Any]]], dict[str, torch.Tensor]],
    reg_weight: float,
    *,
    reg_by_tokens: bool = False,
) -> tuple[dict[str, torch.Tensor], float, float]:
    """Float64 full-batch gradient of the causal-LM loss of :func:`hf_gradacc.testing.tiny.two_term_loss`, written out
    by hand: mean token cross-entropy + ``reg_weight`` x the mean over samples of each row's mean squared logit.
    Returns ``(gradients by parameter name, ce, reg)``.

    ``reg_by_tokens``: divide the penalty's sum by the token count instead (a wrong denominator, to show the size of
    the error a test would catch).

    Example:
        ```python
        grads, ce, reg = two_term_reference(model, samples, PaddingCollator(), reg_weight=0.01)
        ```
    """
    ref = copy.deepcopy(model).double()
    batch = collate(list(samples))
    labels = batch.pop("labels")
    logits = ref(**batch).logits
    logp = torch.log_softmax(logits[:, :-1], -1)
    targets = labels[:, 1:]
    mask = targets != -100
    ce = -(logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask).sum() / mask.sum()
    am = batch["attention_mask"].unsqueeze(-1).double()
    per_row = ((logits**2).mean(-1, keepdim=True) * am).sum(dim=(1, 2)) / am.sum(dim=(1, 2))
    reg = per_row.sum() / (mask.sum() if reg_by_tokens else per_row.numel())
    (ce + reg_weight * reg).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}, float(ce), float(reg)


def compare(update: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> Comparison:
    """Relative error, cosine and norm ratio of ``update`` against ``reference`` over their shared names."""
    names = [n for n in reference if n in update]
    if not names:
        raise GradAccConfigError("no parameter name is shared by the update and the reference")
    u = torch.cat([update[n].double().reshape(-1) for n in names])
    r = torch.cat([reference[n].double().reshape(-1) for n in names])
    rn = r.norm()
    return Comparison(
        relative_error=float((u - r).norm() / rn),
        cosine=float(torch.dot(u, r) / (u.norm() * rn).clamp_min(1e-300)),
        norm_ratio=float(u.norm() / rn),
    )


def batchnorm_statistics(
    model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What precise BatchNorm must give, computed from the layers' inputs: a copy of ``model`` in training mode runs
    every batch (labels dropped); for each BatchNorm layer (by name), the mean over batches of the per-channel batch
    mean of its input, and the mean over batches of the per-channel unbiased batch variance."""
    ref = copy.deepcopy(model).train()
    inputs: dict[str, list[torch.Tensor]] = {}
    for name, module in ref.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.register_forward_hook(lambda mod, args, out, name=name: inputs.setdefault(name, []).append(args[0]))
    with torch.no_grad():
        for batch in batches:
            ref(**{k: v for k, v in batch.items() if k != "labels"})
    stats = {}
    for name, xs in inputs.items():
        dims = [0, *range(2, xs[0].dim())]  # every dimension but the channels
        stats[name] = (
            torch.stack([x.mean(dim=dims) for x in xs]).mean(0),
            torch.stack([x.var(dim=dims, unbiased=True) for x in xs]).mean(0),
        )
    return stats
