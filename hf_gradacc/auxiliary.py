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
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from .errors import GradAccLossError
from .heads import unwrap_model
from .loss import LossTerm

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


def model_aux_terms(model: nn.Module, outputs: Any, num_input_tokens: int) -> dict[str, LossTerm]:
    """The router losses in ``outputs`` (a mixture-of-experts model called with ``output_router_logits``) as loss
    terms normalised by the step's routed tokens; ``{}`` when the model returned none.

    Example:
        ```python
        outputs = mixtral(input_ids=ids, attention_mask=mask, output_router_logits=True)
        terms = model_aux_terms(mixtral, outputs, num_input_tokens=int(mask.sum()))
        # {"aux": LossTerm(total=coef * aux * routed, normalize_by="input_tokens")}
        ```
    """
    if not isinstance(outputs, Mapping):
        return {}
    terms: dict[str, LossTerm] = {}
    for key, (name, coefficient_names) in AUX_OUTPUTS.items():
        value = outputs.get(key)
        if not torch.is_tensor(value):
            continue  # absent, None, or the integer 0 a model returns for a side without routers
        coef = aux_coefficient(model, coefficient_names)
        if coef is None:
            raise GradAccLossError(
                f"The model returned `{key}` but has no `{coefficient_names[0]}` to weight it with, so its share of the "
                "loss is unknown. Override `compute_loss` and return the terms as hf_gradacc.LossTerms, or turn "
                "`output_router_logits` off."
            )
        if coef == 0.0:
            continue
        total = value.reshape(()) * (coef * num_input_tokens)
        terms[name] = LossTerm(total=total, normalize_by="input_tokens")
    return terms
