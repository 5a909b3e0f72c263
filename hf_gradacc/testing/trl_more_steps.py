"""Tiny data and float64 full-batch references for TRL's KTO, Distillation and RLOO trainers.

Each reference is written from the loss's definition (the paper and TRL's docstrings), not from TRL's code: a float64
copy of the initial model(s), every sample of the optimizer step on its own (no padding), explicit shifts and masks.

- **KTO** (Ethayarajh et al. 2024, eq. 7; TRL's ``KTOConfig``): ``r = log pi(y|x) - log pi_ref(y|x)`` summed over the
  completion tokens; the reference point ``z0 = max(0, mean over the step's mismatched pairs (x, y') of
  log pi(y'|x) - log pi_ref(y'|x))``, not differentiated; a desirable sample's loss ``w_d (1 - sigmoid(beta (r -
  z0)))``, an undesirable one's ``w_u (1 - sigmoid(beta (z0 - r)))``; the step's loss is the mean over ALL its samples.
  ``apo_zero_unpaired`` (APO, D'Oosterlinck et al. 2024): ``1 - sigmoid(beta r)`` and ``sigmoid(beta r)``, no ``z0``.
  The mismatched completion of each sample is the one TRL's data preparation pairs it with: completions rotated by
  one within each block of ``per_device_train_batch_size`` samples of the dataset (:func:`kto_kl_completions`).
- **Distillation** (Agarwal et al. 2024, "generalized JSD"; TRL's ``DistillationConfig.beta``): per completion token,
  with the teacher's and the student's next-token distributions ``T`` and ``S`` (logits / temperature), ``beta = 0``:
  ``KL(T || S)``; ``beta = 1``: ``KL(S || T)``; else ``beta KL(T || M) + (1 - beta) KL(S || M)``, ``M = beta T + (1 -
  beta) S``; the step's loss is the sum over every completion token of the step over their number.
- **RLOO** (Ahmadian et al. 2024; TRL's ``RLOOConfig``): each completion's advantage is its reward minus the mean
  reward of the OTHER completions of its prompt; the loss of a completion is ``-A min(rho, clip(rho))`` with the
  sequence ratio ``rho = pi(y|x) / pi_old(y|x)`` (1 at the first step: gradient ``-A grad log pi(y|x)``); the step's
  loss is the mean over ALL its completions.

Example:
    ```python
    from hf_gradacc.testing.trl_more_steps import kto_dataset, kto_reference, kto_rows

    rows = kto_rows(7)
    reference = kto_reference(policy, ref_model, rows, beta=0.1, per_device_train_batch_size=2)
    ```
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .tiny import VOCAB_SIZE
from .trl_steps import EOS_TOKEN_ID, Reference, _backward, _float64, completion_logps, word

__all__ = [
    "CompletionRecorder",
    "distillation_reference",
    "generalized_jsd",
    "kto_dataset",
    "kto_kl_completions",
    "kto_kl_estimate",
    "kto_reference",
    "kto_rows",
    "recorded_completions",
    "rloo_advantages",
    "rloo_advantages_by_prompt",
    "rloo_reference",
]


# ---------------------------------------------------------------------------------------------- KTO
def kto_rows(num_samples: int = 7, seed: int = 5, *, vocab_size: int = VOCAB_SIZE) -> list[dict[str, Any]]:
    """Unpaired preference samples as token ids: a prompt of 1-8 tokens, a completion of 1-6 plus eos, a desirable
    (True) or undesirable (False) label, both kinds present."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_samples):
        rows.append(
            {
                "prompt": [rng.randint(3, vocab_size - 1) for _ in range(rng.randint(1, 8))],
                "completion": [rng.randint(3, vocab_size - 1) for _ in range(rng.randint(1, 6))] + [EOS_TOKEN_ID],
                "label": bool(rng.random() < 0.5) if i > 1 else bool(i == 0),
            }
        )
    return rows


def kto_dataset(rows: Sequence[dict[str, Any]]) -> Any:
    """``rows`` as the text dataset TRL's KTOTrainer takes (``prompt``, ``completion``, ``label``)."""
    from datasets import Dataset

    def text(ids: list[int]) -> str:
        return " ".join(word(i) for i in ids)

    return Dataset.from_list(
        [{"prompt": text(r["prompt"]), "completion": " " + text(r["completion"]), "label": r["label"]} for r in rows]
    )


def kto_kl_completions(rows: Sequence[dict[str, Any]], per_device_train_batch_size: int) -> list[list[int]]:
    """The mismatched completion y' of each sample: within each block of ``per_device_train_batch_size`` consecutive
    samples, sample i takes the completion of sample i - 1 (the block's first takes its last)."""
    out: list[list[int]] = []
    for start in range(0, len(rows), per_device_train_batch_size):
        block = [r["completion"] for r in rows[start : start + per_device_train_batch_size]]
        out += [block[-1], *block[:-1]]
    return out


def _sequence_logp(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = prompt + completion
    return completion_logps(model, ids, [0] * len(prompt) + [1] * len(completion)).sum()


def kto_kl_estimate(
    policy: torch.nn.Module,
    ref_model: torch.nn.Module,
    rows: Sequence[dict[str, Any]],
    per_device_train_batch_size: int,
) -> float:
    """``z0``: max(0, the mean over ALL the step's mismatched pairs of log pi(y'|x) - log pi_ref(y'|x)), float64."""
    policy, ref_model = _float64(policy), _float64(ref_model)
    kl_completions = kto_kl_completions(rows, per_device_train_batch_size)
    with torch.no_grad():
        values = [
            _sequence_logp(policy, r["prompt"], y) - _sequence_logp(ref_model, r["prompt"], y)
            for r, y in zip(rows, kl_completions, strict=True)
        ]
    return max(0.0, float(torch.stack(values).mean()))


def kto_reference(
    model: torch.nn.Module,
    ref_model: torch.nn.Module,
    rows: Sequence[dict[str, Any]],
    *,
    beta: float,
    per_device_train_batch_size: int,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> Reference:
    """The step's KTO loss (module docstring): the mean over ALL samples, with the step's ``z0``."""
    z0 = kto_kl_estimate(model, ref_model, rows, per_device_train_batch_size) if loss_type == "kto" else 0.0
    policy, frozen = _float64(model), _float64(ref_model)
    losses = []
    for row in rows:
        logp = _sequence_logp(policy, row["prompt"], row["completion"])
        with torch.no_grad():
            ref_logp = _sequence_logp(frozen, row["prompt"], row["completion"])
        r = logp - ref_logp
        if loss_type == "kto":
            value = 1 - torch.sigmoid(beta * (r - z0)) if row["label"] else 1 - torch.sigmoid(beta * (z0 - r))
        elif loss_type == "apo_zero_unpaired":
            value = 1 - torch.sigmoid(beta * r) if row["label"] else torch.sigmoid(beta * r)
        else:
            raise ValueError(f"no reference for loss_type {loss_type!r}")
        losses.append((desirable_weight if row["label"] else undesirable_weight) * value)
    return _backward(policy, torch.stack(losses).mean())


# ---------------------------------------------------------------------------------------------- on-policy steps
class CompletionRecorder:
    """Trainer mixin (put it first): keeps every micro-batch ``compute_loss`` receives in training, on CPU
    (``recorded_micro_batches``: prompt and completion ids and masks, and advantages where the trainer has them)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
            recorded = {k: inputs[k].detach().cpu().clone() for k in keys if k in inputs}
            self.recorded_micro_batches = [*getattr(self, "recorded_micro_batches", []), recorded]
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )


def recorded_completions(micro_batches: Sequence[dict[str, torch.Tensor]]) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, completion ids)`` of every recorded row, padding removed."""
    rows = []
    for mb in micro_batches:
        for i in range(mb["prompt_ids"].shape[0]):
            prompt = mb["prompt_ids"][i][mb["prompt_mask"][i].bool()].tolist()
            rows.append((prompt, mb["completion_ids"][i][mb["completion_mask"][i].bool()].tolist()))
    return rows


# ---------------------------------------------------------------------------------------------- Distillation
def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """Per position: the generalized Jensen-Shannon divergence between the teacher's and the student's next-token
    distributions (``beta`` 0: KL(T || S), 1: KL(S || T), else beta KL(T || M) + (1 - beta) KL(S || M))."""
    log_s, log_t = F.log_softmax(student_logits, dim=-1), F.log_softmax(teacher_logits, dim=-1)

    def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:  # KL(p || q), over the vocabulary
        return (log_p.exp() * (log_p - log_q)).sum(-1)

    if beta == 0.0:
        return kl(log_t, log_s)
    if beta == 1.0:
        return kl(log_s, log_t)
    log_m = torch.logsumexp(torch.stack([log_t + math.log(beta), log_s + math.log(1 - beta)]), dim=0)
    return beta * kl(log_t, log_m) + (1 - beta) * kl(log_s, log_m)


def distillation_reference(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    sequences: Sequence[tuple[list[int], list[int]]],
    *,
    beta: float,
    temperature: float = 1.0,
) -> Reference:
    """The step's distillation loss over ``(prompt ids, completion ids)`` (padding removed): the sum over every
    completion token of the generalized JSD at the position predicting it, over the step's completion tokens."""
    policy, frozen = _float64(student), _float64(teacher)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for prompt, completion in sequences:
        if not completion:
            continue
        ids = torch.tensor([prompt + completion])
        positions = slice(len(prompt) - 1, len(prompt) + len(completion) - 1)  # position j predicts token j + 1
        s = policy(input_ids=ids).logits[0, positions].double() / temperature
        with torch.no_grad():
            t = frozen(input_ids=ids).logits[0, positions].double() / temperature
        total = total + generalized_jsd(s, t, beta).sum()
        count += len(completion)
    return _backward(policy, total / max(count, 1))


# ---------------------------------------------------------------------------------------------- RLOO
def rloo_advantages(rewards: Sequence[float], num_generations: int) -> list[float]:
    """Each completion's reward minus the mean reward of the other completions of its prompt (consecutive groups of
    ``num_generations``)."""
    out = []
    for start in range(0, len(rewards), num_generations):
        group = list(rewards[start : start + num_generations])
        out += [r - (sum(group) - r) / (len(group) - 1) for r in group]
    return out


def rloo_advantages_by_prompt(
    rows: Sequence[tuple[list[int], list[int]]], reward: Any, num_generations: int
) -> list[float]:
    """The leave-one-out advantage of each ``(prompt ids, completion ids)`` row, its prompt's generations found by
    their prompt ids (each prompt must appear ``num_generations`` times): ``reward(completion ids)`` minus the mean
    reward of the prompt's other completions."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (prompt, _) in enumerate(rows):
        groups.setdefault(tuple(prompt), []).append(index)
    if any(len(members) != num_generations for members in groups.values()):
        raise ValueError(f"every prompt needs {num_generations} completions among the rows: {list(groups.values())}")
    rewards = [float(reward(completion)) for _, completion in rows]
    advantages = [0.0] * len(rows)
    for members in groups.values():
        for i, a in zip(members, rloo_advantages([rewards[m] for m in members], num_generations), strict=True):
            advantages[i] = a
    return advantages


def rloo_reference(policy: torch.nn.Module, rows: Sequence[tuple[list[int], list[int], float]]) -> Reference:
    """The step's RLOO loss at ratio 1 over ``(prompt ids, completion ids, advantage)``: the mean over ALL the step's
    completions of ``-A rho`` with ``rho = exp(log pi(y|x) - log pi(y|x).detach())`` (value -A, gradient
    -A grad log pi(y|x))."""
    model = _float64(policy)
    losses = []
    for prompt, completion, advantage in rows:
        if not completion:
            losses.append(torch.zeros((), dtype=torch.float64))
            continue
        logp = _sequence_logp(model, prompt, completion)
        losses.append(-advantage * torch.exp(logp - logp.detach()))
    return _backward(model, torch.stack(losses).mean())
