"""Auxiliary terms a model adds to its own loss — mixture-of-experts router load-balancing and z-losses — kept as
loss terms of their own, so that the loss the model defines is the loss trained.

A router loss is a per-forward function of the micro-batch's routing (a product of two means over its routed
tokens), so it cannot be summed like a token loss. The rule of one optimizer step over micro-batches ``m`` on every
rank is

    sum_m (routed tokens of m / routed tokens of the step) x coef x aux(m)

where routed tokens are the ``attention_mask == 1`` positions (every position without a mask) — the denominator
``"input_tokens"``. One micro-batch on one rank gives exactly the model's own ``coef x aux``. Each term is a
:class:`~hf_gradacc.LossTerm` ``(coef x aux(m) x routed(m), "input_tokens")``, logged as ``loss/<name>``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from .errors import GradAccLossError
from .heads import unwrap_model
from .loss import LossTerm
from .moe_balance import StepRouting, router_logits_of, routing_counts

BALANCE_TERM = "aux"  # the load-balancing loss of a decoder-only MoE (`aux_loss`), the one router_balance forms
# Output key -> (term name, the coefficient the model multiplies it by, as attribute names to look up in order).
AUX_OUTPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "aux_loss": ("aux", ("router_aux_loss_coef", "aux_loss_coef")),
    "encoder_aux_loss": ("encoder_aux", ("router_aux_loss_coef",)),
    "decoder_aux_loss": ("decoder_aux", ("router_aux_loss_coef",)),
    "encoder_z_loss": ("encoder_z", ("router_z_loss_coef",)),
    "decoder_z_loss": ("decoder_z", ("router_z_loss_coef",)),
}


def aux_coefficient(model: nn.Module, names: tuple[str, ...]) -> float | None:
    """The coefficient the model multiplies a router loss by: the model attribute it set at ``__init__`` (what its
    forward reads), else the config's (``text_config`` for vision-language models). None when it has none."""
    base = unwrap_model(model)
    config = getattr(base, "config", None)
    for owner in (base, config, getattr(config, "text_config", None)):
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                return float(value)
    return None


def model_aux_terms(
    model: nn.Module,
    outputs: Any,
    num_input_tokens: int | Callable[[], int],
    *,
    routing: StepRouting | None = None,
    attention_mask: Any = None,
    index: int | None = None,
) -> dict[str, LossTerm]:
    """The router losses in ``outputs`` (a mixture-of-experts model called with ``output_router_logits``) as loss
    terms normalised by the step's routed tokens; ``{}`` when the model returned none.

    ``routing`` (the step's :class:`~hf_gradacc.moe_balance.StepRouting`, with the micro-batch's ``attention_mask``
    and ``index``): under ``router_balance="global_batch"`` (its ``global_counts`` set) the ``aux`` term is the
    micro-batch's share of the step's ONE balance loss (:mod:`hf_gradacc.moe_balance`); otherwise the micro-batch's
    routing is only recorded there, for ``moe/load_max_over_mean``. ``num_input_tokens``: the micro-batch's routed
    tokens (the window's count in training), or a function that counts them, called only when there are router terms.

    Example:
        ```python
        outputs = mixtral(input_ids=ids, attention_mask=mask, output_router_logits=True)
        terms = model_aux_terms(mixtral, outputs, num_input_tokens=int(mask.sum()))
        # {"aux": LossTerm(total=coef * aux * routed, normalize_by="input_tokens")}
        ```
    """
    found = _router_losses(model, outputs)
    if found and callable(num_input_tokens):  # counted only for a model that returns router terms
        num_input_tokens = num_input_tokens()
    terms = {
        name: LossTerm(total=value * (coef * num_input_tokens), normalize_by="input_tokens")
        for name, value, coef in found
    }
    balance = [(value, coef) for name, value, coef in found if name == BALANCE_TERM]
    if routing is not None and routing.global_counts is not None and balance:
        value, coef = balance[0]
        terms[BALANCE_TERM] = term = routing.global_term(outputs, attention_mask, coef, index=index, model_aux=value)
        own = outputs.get("loss")
        if torch.is_tensor(own) and own.numel() == 1 and num_input_tokens:
            # the start-up check compares the model's own loss with the micro-batch's terms: its per-micro-batch
            # balance term is replaced by this micro-batch's share of the step's one (the formula is checked apart)
            outputs["loss"] = (own - coef * value + term.total / num_input_tokens).detach()
    elif routing is not None and balance:
        logits = router_logits_of(outputs)
        if logits is not None:
            routing.add_local(routing_counts(logits, attention_mask, routing.shape))
    return terms


def _router_losses(model: nn.Module, outputs: Any) -> list[tuple[str, torch.Tensor, float]]:
    """``(term name, the scalar router loss, its coefficient)`` for each router loss in ``outputs`` with a non-zero
    coefficient."""
    if not isinstance(outputs, Mapping):
        return []
    found = []
    for key, (name, coefficient_names) in AUX_OUTPUTS.items():
        value = outputs.get(key)
        if not torch.is_tensor(value):
            continue  # absent, None, or the integer 0 a model returns for a side without routers
        coef = aux_coefficient(model, coefficient_names)
        if coef is None:
            raise GradAccLossError(
                f"The model returned `{key}` but has no `{coefficient_names[0]}` to weight it with, so its share of "
                "the "
                "loss is unknown. Override `compute_loss` and return the terms as hf_gradacc.LossTerms, or turn "
                "`output_router_logits` off."
            )
        if coef != 0.0:
            found.append((name, value.reshape(()), coef))
    return found


def returns_router_loss(model: nn.Module, outputs_seen: list[Any]) -> bool:
    """Whether any of the forward passes in ``outputs_seen`` returned a router loss with a non-zero coefficient."""
    return any(_router_losses(model, outputs) for outputs in outputs_seen)


def split_model_loss(
    model: nn.Module,
    plain: torch.Tensor,
    outputs_seen: list[Any],
    *,
    main_count: int,
    main_denominator: str,
    num_input_tokens: int,
) -> dict[str, LossTerm] | None:
    """A plain loss an overridden ``compute_loss`` returned that IS a mixture-of-experts model's own ``outputs.loss``
    (equal in value to the loss of one of the forward passes in ``outputs_seen``), split into its terms: the head's
    loss as the mean over the micro-batch's ``main_count`` counted items (``LossTerm(mean x count,
    main_denominator)``) and each router term by the rule above. None when ``plain`` is no such model's loss, or the
    model returned no router loss (then a plain mean is exact as it is).

    Frameworks return ``outputs.loss``: read whole as a mean over target tokens, its ``coef x aux`` part would be
    weighted by target tokens instead of routed tokens.

    Example:
        ```python
        outputs = mixtral(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        terms = split_model_loss(mixtral, outputs.loss, [outputs], main_count=num_targets, main_denominator="tokens",
                                 num_input_tokens=int(mask.sum()))
        # {"main": LossTerm(ce_mean * num_targets, "tokens"), "aux": LossTerm(coef * aux * routed, "input_tokens")}
        ```
    """
    for outputs in outputs_seen:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
        if not (
            torch.is_tensor(loss) and loss.numel() == 1 and torch.equal(loss.detach().reshape(()), plain.detach())
        ):
            continue
        routers = _router_losses(model, outputs)
        if not routers:
            return None
        main_mean = plain - sum(coef * value for _, value, coef in routers)
        main = main_mean * main_count if main_count else plain.new_zeros(())  # no counted item: 0/0 in the model
        terms = {"main": LossTerm(total=main, normalize_by=main_denominator)}
        terms.update(model_aux_terms(model, outputs, num_input_tokens))
        return terms
    return None
