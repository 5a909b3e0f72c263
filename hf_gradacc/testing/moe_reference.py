"""The float64 reference of global-batch router load balancing (definition B), written from the definition; it shares
no code with the trainer (nor with :mod:`hf_gradacc.moe_balance`).

For the optimizer step's samples ``S`` (every micro-batch, every rank) in ONE forward of a float64 copy:

    loss(S) = mean token cross-entropy over S + coef x E x sum_e f_e(S) x P_e(S)

``f_e``: the top-k assignments of S's routed tokens (``attention_mask == 1``) to expert ``e``, summed over the MoE
layers, over (routed tokens x layers); ``P_e``: their router probabilities (softmax of each layer's router logits)
summed likewise, over the same. ``f`` is a count (no gradient), as in the models' own ``load_balancing_loss_func``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .reference import float64_copy, full_batch_loss, router_coefficient


def _experts_and_top_k(model: torch.nn.Module) -> tuple[int, int]:
    config = model.config
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return int(experts), int(config.num_experts_per_tok)


def global_balance_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    perturb: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(coef x aux(S), f(S))`` of one collated float64 batch holding the whole step. ``perturb``: applied to the
    ``[experts]`` assignment counts before they are used (to show a test can fail)."""
    experts, top_k = _experts_and_top_k(model)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    gates = model(**inputs, output_router_logits=True).router_logits
    mask = batch["attention_mask"].reshape(-1).double()
    counts = torch.zeros(experts, dtype=torch.float64)
    probs = torch.zeros(experts, dtype=torch.float64)
    for gate in gates:
        p = torch.softmax(gate.double(), dim=-1)
        chosen = torch.topk(p.detach(), top_k, dim=-1).indices
        one_hot = torch.zeros_like(p).scatter_(1, chosen, 1.0)
        counts = counts + (one_hot * mask[:, None]).sum(0)
        probs = probs + (p * mask[:, None]).sum(0)
    if perturb is not None:
        counts = perturb(counts)
    rows = mask.sum() * len(gates)
    fractions = counts / rows
    aux = experts * (fractions * (probs / rows)).sum()
    return router_coefficient(model) * aux, fractions


def global_balance_gradients(
    model: torch.nn.Module,
    samples: Sequence[dict[str, Any]],
    collate: Callable[[Sequence[dict[str, Any]]], dict[str, torch.Tensor]],
    *,
    perturb: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Float64 gradient of definition B's step loss over ``samples`` (all of the step, every rank), by name.

    Example:
        ```python
        reference = global_balance_gradients(build_tiny_moe("mixtral"), samples, PaddingCollator())
        ```
    """
    ref = float64_copy(model)
    batch = collate(list(samples))
    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
    ref.zero_grad()
    loss = full_batch_loss(ref, batch, "causal_lm") + global_balance_loss(ref, batch, perturb=perturb)[0]
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.requires_grad and p.grad is not None}
