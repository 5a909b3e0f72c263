"""Global-batch router load balancing (``router_balance="global_batch"``): the mixture-of-experts balance loss of an
optimizer step formed ONCE over every routed token of the step, on every micro-batch and every data-parallel rank.

The models' own loss (``load_balancing_loss_func``, shared by Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek, gpt-oss, Jamba,
GraniteMoE and the others in transformers 5.24) is, for the tokens ``S`` it sees,

    aux(S) = E x sum_e f_e(S) x P_e(S),   f_e = C_e / R,   P_e = Q_e / R

with ``C_e`` the top-k assignments of routed tokens to expert ``e`` summed over the MoE layers, ``Q_e`` their router
probabilities summed likewise, and ``R`` the routed tokens times the layers (``attention_mask == 1`` positions; every
position without a mask). ``"micro_batch"`` (:mod:`hf_gradacc.auxiliary`) applies it per micro-batch; here ``S`` is
the whole step. ``f`` is not differentiable (top-k counts), so the gradient of ``coef x aux(S)`` is
``coef x E / R^2 x sum_e C_e(S) x dQ_e``, and ``Q_e(S)`` is a sum over micro-batches: micro-batch ``m`` contributes

    coef x E x sum_e C_e(S) x Q_e(m) / R(S)^2

which needs the step's counts ``C(S)`` before its backward pass. They come from a **routing pre-pass**
(:func:`routing_prepass`): one forward of every micro-batch of the prefetched window without gradient (the LM head
skipped), the counts summed over ranks in ONE collective. The training forwards then read their own router logits
(``outputs.router_logits``, never a hook, so activation checkpointing's recomputation cannot count twice), and each
micro-batch's routing is compared with the pre-pass's (a warning when they differ). The sum of the contributions
is ``coef x aux(S)`` exactly, in value and gradient.

Routing that is random in training (dropout, router jitter) would differ between the pre-pass and the training
forward: it is refused by name, as is every setup the pre-pass was not shown exact for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
import torch.nn as nn
from transformers.utils import logging

from .errors import GradAccConfigError, GradAccLossError
from .heads import unwrap_model
from .loss import LossTerm

logger = logging.get_logger(__name__)

RouterBalance = Literal["micro_batch", "global_batch"]
ROUTER_BALANCES: tuple[str, ...] = get_args(RouterBalance)
ROUTER_LOGITS_KEY = "router_logits"
LOAD_KEY = "moe/load_max_over_mean"
# the model's own aux(m) against the one rebuilt from its router logits (float32 sums of a few thousand terms)
FORMULA_TOLERANCE = 1e-3


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterShape:
    """What the model passes to its ``load_balancing_loss_func``: ``num_experts`` and ``top_k``."""

    num_experts: int
    top_k: int


def router_shape(model: nn.Module) -> RouterShape | None:
    """The experts and top-k the model's forward passes to its balance loss (``self.num_experts``,
    ``self.num_experts_per_tok``); None when the model has no such attributes."""
    base = unwrap_model(model)
    experts, top_k = getattr(base, "num_experts", None), getattr(base, "num_experts_per_tok", None)
    if isinstance(experts, int) and isinstance(top_k, int) and experts > 0 and top_k > 0:
        return RouterShape(num_experts=experts, top_k=top_k)
    return None


def _flat_mask(attention_mask: Any, rows: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2 or attention_mask.numel() != rows:
        raise GradAccLossError(
            "router_balance='global_batch' reads the routed tokens from a 2-D `attention_mask` as the model's "
            "balance "
            f"loss does; got {getattr(attention_mask, 'shape', type(attention_mask).__name__)} for {rows} router "
            "rows. "
            "Pass a 2-D padding mask (or none), or set `router_balance='micro_batch'`."
        )
    return attention_mask.reshape(-1)


def routing_counts(router_logits: Sequence[torch.Tensor], attention_mask: Any, shape: RouterShape) -> torch.Tensor:
    """``[layers, experts + 1]`` int64: per MoE layer, the top-k assignments of the routed tokens to each expert and,
    last, the routed tokens (the model's ``softmax`` then ``topk`` of each layer's router logits, masked)."""
    rows = []
    for gate in router_logits:
        with torch.no_grad():
            probs = torch.softmax(gate, dim=-1)
            _, chosen = torch.topk(probs, shape.top_k, dim=-1)
            mask = _flat_mask(attention_mask, gate.shape[0])
            weight = (
                torch.ones_like(chosen) if mask is None else mask.to(chosen.device).long()[:, None].expand_as(chosen)
            )
            counts = torch.zeros(shape.num_experts, dtype=torch.int64, device=gate.device)
            counts.scatter_add_(0, chosen.reshape(-1), weight.reshape(-1).long())
            routed = counts.new_tensor([gate.shape[0] if mask is None else int(mask.sum())])
        rows.append(torch.cat([counts, routed]))
    return torch.stack(rows).cpu()


def router_prob_sums(router_logits: Sequence[torch.Tensor], attention_mask: Any) -> torch.Tensor:
    """``[experts]`` float32: the routed tokens' router probabilities summed over tokens and MoE layers (``Q(m)``),
    with gradient."""
    total = None
    for gate in router_logits:
        probs = torch.softmax(gate, dim=-1).float()
        mask = _flat_mask(attention_mask, gate.shape[0])
        layer = probs.sum(0) if mask is None else (probs * mask.to(probs.device, torch.float32)[:, None]).sum(0)
        total = layer if total is None else total + layer.to(total.device)
    return total


def router_logits_of(outputs: Any) -> tuple[torch.Tensor, ...] | None:
    logits = outputs.get(ROUTER_LOGITS_KEY) if isinstance(outputs, Mapping) else None
    if isinstance(logits, (tuple, list)) and logits and all(torch.is_tensor(g) and g.dim() == 2 for g in logits):
        return tuple(logits)
    return None


@dataclass(eq=False)
class StepRouting:
    """One optimizer step's routing: this rank's assignments (for ``moe/load_max_over_mean``) and, with
    ``"global_batch"``, every rank's from the pre-pass (``global_counts``: ``[layers, experts + 1]``, routed tokens
    last) plus the pre-pass counts of each of this rank's micro-batches.

    Attributes:
        shape: the model's experts and top-k.
        local_counts: this rank's ``[layers, experts + 1]`` counts of the step (training forwards, or the pre-pass).
        global_counts: every rank's, summed (``"global_batch"`` only).
        prepass: the pre-pass counts of each micro-batch of this rank, to check the training forward's routing.
        num_input_tokens: the step's ``input_tokens`` count over every rank (what the term is normalised by).
    """

    shape: RouterShape
    local_counts: torch.Tensor | None = None
    global_counts: torch.Tensor | None = None
    prepass: list[torch.Tensor] = field(default_factory=list)
    num_input_tokens: int = 0

    def add_local(self, counts: torch.Tensor) -> None:
        self.local_counts = counts.clone() if self.local_counts is None else self.local_counts + counts

    def global_term(
        self, outputs: Any, attention_mask: Any, coef: float, *, index: int | None, model_aux: Any = None
    ) -> LossTerm:
        """Micro-batch ``index``'s share of ``coef x aux(S)``: ``coef x E x sum_e C_e(S) x Q_e(m) / R(S)^2`` as a
        :class:`~hf_gradacc.LossTerm` normalised by the step's ``input_tokens`` (the window divides by that count
        and applies the backend's loss scale, so the total is multiplied by it here)."""
        logits = router_logits_of(outputs)
        if logits is None or self.global_counts is None:
            raise GradAccLossError(
                "router_balance='global_batch': the model's forward returned no `router_logits` (a tuple of per-layer "
                "[tokens x experts] tensors); keep `output_router_logits=True` in its config, or set "
                "`router_balance='micro_batch'`."
            )
        counts = routing_counts(logits, attention_mask, self.shape)
        if counts.shape != self.global_counts.shape:
            raise GradAccLossError(
                f"router_balance='global_batch': the training forward routed through {counts.shape[0]} MoE layer(s), "
                f"the pre-pass through {self.global_counts.shape[0]}; set `router_balance='micro_batch'`."
            )
        self._check_routing(counts, index)
        probs = router_prob_sums(logits, attention_mask)
        _check_model_formula(counts, probs, model_aux, self.shape)
        experts, rows = self.global_counts[:, :-1].sum(0).double(), float(self.global_counts[:, -1].sum())
        if rows == 0:
            return LossTerm(total=probs.sum() * 0.0, normalize_by="input_tokens")
        weight = (coef * self.shape.num_experts / rows**2) * experts
        value = (weight.to(probs.device, probs.dtype) * probs).sum()
        return LossTerm(total=value * self.num_input_tokens, normalize_by="input_tokens")

    def _check_routing(self, counts: torch.Tensor, index: int | None) -> None:
        expected = self.prepass[index] if index is not None and index < len(self.prepass) else None
        if expected is not None and not torch.equal(expected, counts):
            moved = int((expected[:, :-1] - counts[:, :-1]).abs().sum()) // 2
            logger.warning(
                f"router_balance='global_batch': micro-batch {index + 1} routed {moved} assignment(s) differently in "
                "its training forward than in the routing pre-pass (non-deterministic kernels or random routing), so "
                "this step's expert fractions are the pre-pass's: the update is within that many tokens of the "
                "global-batch definition, not exact."
            )


def _check_model_formula(counts: torch.Tensor, probs: torch.Tensor, model_aux: Any, shape: RouterShape) -> None:
    """The model's own ``aux_loss`` of the micro-batch against the one rebuilt from its router logits: a model whose
    router statistics are read otherwise (probabilities recorded instead of logits, another top-k) is refused."""
    if not torch.is_tensor(model_aux):
        return
    rows = float(counts[:, -1].sum())
    if rows == 0:
        return
    rebuilt = shape.num_experts * float(
        (counts[:, :-1].sum(0).double() / rows * probs.detach().double().cpu() / rows).sum()
    )
    own = float(model_aux.detach().double())
    if abs(rebuilt - own) > FORMULA_TOLERANCE * max(abs(own), 1e-12):
        raise GradAccConfigError(
            f"router_balance='global_batch': this model's own load-balancing loss ({own:.6g}) is not E x sum_e f_e x "
            f"P_e of its router logits ({rebuilt:.6g}), so its router statistics cannot be read to form it over the "
            "step. Set `router_balance='micro_batch'`."
        )


# ------------------------------------------------------------------------------------------------ setup, the pre-pass
def stochastic_routing(model: nn.Module) -> list[str]:
    """The settings that make a training forward's routing random (dropout, router jitter), as ``name=value``."""
    base = unwrap_model(model)
    found = []
    config = getattr(base, "config", None)
    for owner in (config, getattr(config, "text_config", None)):
        for name, value in (vars(owner) if owner is not None else {}).items():
            if (
                ("dropout" in name or "jitter" in name)
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
            ):
                if value > 0:
                    found.append(f"config.{name}={value}")
    for name, module in base.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            found.append(f"{name}.p={module.p}")
    return sorted(set(found))


def check_router_balance(
    *, settings: Any, head: Any, model: nn.Module, backend: Any, custom_loss: bool, trainer_name: str
) -> RouterShape | None:
    """Validate ``router_balance`` against the model and the trainer once, at construction (every rank alike: it
    reads only the model and the settings). Returns the router shape the pre-pass needs, or None
    (``"micro_batch"``, or a model without router logits: a warning). ``custom_loss``: the trainer computes its loss
    itself (an overridden ``compute_loss`` or a ``compute_loss_func``)."""
    if settings.router_balance != "global_batch":
        return None
    base = unwrap_model(model)
    name = type(base).__name__
    config = getattr(base, "config", None)
    if not getattr(config, "output_router_logits", False):
        logger.warning(
            f"`router_balance='global_batch'` is ignored: {name} does not return router logits "
            "(`config.output_router_logits` is False), so it trains no load-balancing loss."
        )
        return None
    shape = router_shape(base)
    refusals = []
    if shape is None or head.type != "causal_lm":
        refusals.append(
            f"{name}'s router statistics cannot be read (supported: the decoder-only causal LMs whose forward calls "
            "transformers' `load_balancing_loss_func` with `num_experts` and `num_experts_per_tok`)"
        )
    random = stochastic_routing(base)
    if random:
        refusals.append(
            f"training routes at random ({', '.join(random)}; the pre-pass would route otherwise): set them to 0"
        )
    if custom_loss:
        refusals.append(
            f"{trainer_name} computes its own loss (an overridden `compute_loss` or "
            "`compute_loss_func`: TRL trainers, custom losses)"
        )
    for knob in ("defer_normalization", "auto_micro_batch"):
        if getattr(settings, knob):
            refusals.append(f"`{knob}` is set")
    if backend.model_parallelism is not None:
        refusals.append(
            f"{backend.model_parallelism} on the {backend.describe()} backend (ranks holding copies or "
            "shards of the same tokens)"
        )
    if refusals:
        raise GradAccConfigError(
            "`router_balance='global_batch'` is not supported here: " + "; ".join(refusals) + ". Set "
            "`router_balance='micro_batch'` (the model's per-micro-batch rule) or change the setting."
        )
    return shape


@contextlib.contextmanager
def _head_skipped(base: nn.Module) -> Iterator[None]:
    """The output layer returns a ``[..., 1]`` placeholder: the pre-pass needs the routing, not the logits (its
    hooks, ZeRO-3's gather and FSDP2's unshard, still run)."""
    head = base.get_output_embeddings() if callable(getattr(base, "get_output_embeddings", None)) else None
    if head is None:
        yield
        return
    missing = object()
    before = head.__dict__.get("forward", missing)
    head.forward = lambda hidden, *args, **kwargs: hidden[..., :1]  # type: ignore[method-assign]
    try:
        yield
    finally:
        if before is missing:
            del head.forward
        else:
            head.forward = before  # type: ignore[method-assign]


def routing_prepass(
    model: nn.Module,
    micro_batches: Sequence[Mapping[str, Any]],
    *,
    shape: RouterShape,
    prepare: Any,
    all_gather: Any,
    device: torch.device | str,
    num_input_tokens: int,
    drop_keys: Sequence[str] = ("labels", "shift_labels"),
) -> StepRouting:
    """The step's routing before its first training forward: every micro-batch of this rank forwarded without
    gradient (training mode, LM head skipped), its counts summed over ranks in ONE collective (``all_gather``:
    every rank's row stacked).

    Example:
        ```python
        routing = routing_prepass(model, window.micro_batches, shape=router_shape(model), prepare=lambda b: b,
                                  all_gather=lambda t: t[None], device="cpu",
                                  num_input_tokens=window.global_count("input_tokens"))
        routing.global_counts[:, :-1]   # [layers, experts]: top-k assignments over the whole step
        ```
    """
    base = unwrap_model(model)
    routing = StepRouting(shape=shape, num_input_tokens=num_input_tokens)
    model.train()
    with torch.no_grad(), _head_skipped(base):
        for batch in micro_batches:
            inputs = {k: v for k, v in prepare(batch).items() if k not in drop_keys}
            outputs = model(**inputs, output_router_logits=True)
            logits = router_logits_of(outputs)
            if logits is None:
                raise GradAccLossError(
                    f"router_balance='global_batch': {type(base).__name__} returned no `router_logits` in the routing "
                    "pre-pass; set `router_balance='micro_batch'`."
                )
            counts = routing_counts(logits, inputs.get("attention_mask"), shape)
            routing.prepass.append(counts)
            routing.add_local(counts)
            del outputs, logits
    local = routing.local_counts
    if local is None:  # no micro-batch on this rank (train_window stops every rank before this)
        raise GradAccLossError("router_balance='global_batch': the routing pre-pass ran on no micro-batch")
    gathered = all_gather(local.reshape(-1).to(device))
    routing.global_counts = gathered.reshape(-1, *local.shape).sum(0).cpu()
    return routing


# ------------------------------------------------------------------------------------------------ the load log
@dataclass
class MoeLoadLog:
    """Each optimizer step's expert load on this rank (``[layers, experts + 1]`` counts), summed over ranks at log
    time: ``moe/load_max_over_mean`` (the most loaded expert over the mean load, per layer, averaged over layers, then
    over the steps since the last log line) and ``.../layer_<i>``. The sum rides in the log line's one collective with
    the loss terms (``window.TermLog.pop_means``): no collective of its own. Every rank holds the same number of steps
    (each step is on every rank), so every rank gathers the same shape."""

    steps: list[torch.Tensor] = field(default_factory=list)

    def add(self, routing: StepRouting | None) -> None:
        if routing is not None and routing.local_counts is not None:
            self.steps.append(routing.local_counts)

    def take(self) -> torch.Tensor | None:
        """This rank's ``[steps, layers, experts + 1]`` counts since the last log line, then reset; None when there
        are none (or the steps' shapes differ)."""
        steps, self.steps = self.steps, []
        if not steps or len({tuple(s.shape) for s in steps}) != 1:
            return None
        return torch.stack(steps)

    @staticmethod
    def logs(counts: torch.Tensor) -> dict[str, float]:
        """The log keys from :meth:`take`'s counts summed over ranks."""
        counts = counts.double().cpu()[..., :-1]  # [steps, L, E]
        mean = counts.mean(-1).clamp_min(1e-12)
        ratio = (counts.max(-1).values / mean).mean(0)  # [L], over steps
        logs = {LOAD_KEY: float(ratio.mean())}
        logs.update({f"{LOAD_KEY}/layer_{i}": float(r) for i, r in enumerate(ratio.tolist())})
        return logs
