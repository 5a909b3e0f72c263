"""The float64 full-batch step of every GRPO ``loss_type``, written from each loss's definition (the papers and TRL's
``GRPOConfig`` docstring), at any optimizer step: the policy of the step, the old policy of the generation step (the
importance ratio), clipping and soft gates included. It shares no code with TRL or the trainers.

GRPO trains on completions the policy sampled: the reference cannot be written before the run. A trainer with
:class:`GRPOPolicyRecorder` in front keeps, for every optimizer step, the parameters at the step's start and every
micro-batch it trained on (prompt and completion ids and masks, advantages, and the step at which the completions were
generated). :func:`grpo_step_reference` recomputes each completion's log-probabilities on its own (no padding) with a
float64 copy of the step's policy, and the old log-probabilities with a float64 copy of the generation step's policy,
then writes out the loss. Notation: ``A_i`` the advantage of completion ``i``, ``l_it = log pi(o_it) - log
pi_old(o_it)``, ``r_it = exp(l_it)`` (``importance_sampling_level="sequence"``: ``exp(mean_t l_it)`` for every ``t``).

| ``loss_type`` | per-token value ``v_it`` | the step's loss |
| --- | --- | --- |
| ``grpo`` | ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` (PPO clip) | mean over the sequences of ``mean_t v_it`` |
| ``bnpo`` | as ``grpo`` | ``sum v / tokens`` of the "local batch" (see below) |
| ``dr_grpo`` | as ``grpo`` | ``sum v / (sequences x max_completion_length)`` |
| ``dapo`` | as ``grpo`` | ``sum v / tokens`` of the step (the "global accumulated batch") |
| ``cispo`` | ``-sg(min(r, eps_high)) A log pi`` (MiniMax-M1 / ScaleRL) | ``sum v / tokens`` of the step |
| ``sapo`` | ``-sigmoid(tau (r - 1)) 4 / tau A``, ``tau`` by the sign of ``A`` (SAPO) | as ``grpo`` |
| ``luspo`` | as ``grpo``, sequence-level ratio (GSPO) | mean over the sequences of ``sum_t v_it`` (scaled by length) |
| ``vespo`` | ``-sg(phi(w)) A log pi``, ``phi(w) = e^lam w^k e^(-lam w)``, ``w = exp(sum_t l_it)`` | as ``dapo`` |

"The step" is every completion of every micro-batch of the optimizer step on every process (a completion met twice in
one step, as ``num_iterations`` allows, counts twice). ``bnpo`` is the one loss defined on the split: TRL's docstring
normalises it "over the local batch only" (one micro-batch of one process). ``bnpo_scope="step"`` takes the step as
that batch (what GradAccGRPOTrainer trains: then ``bnpo`` is ``dapo``), ``bnpo_scope="micro_batch"`` the definition
taken literally (the mean over micro-batches of each one's token mean; TRL's stock step). A completion with no token
counts as a sequence of value 0. ``vespo``'s normaliser is not in TRL's docstring: the step's tokens, as ``dapo``.
In the PPO clip of ``grpo`` (and of the losses "as ``grpo``") ``delta`` caps ``r``.

Example:
    ```python
    trainer_class = type("Recording", (GRPOPolicyRecorder, GradAccGRPOTrainer), {})
    trainer = trainer_class(model=copy.deepcopy(policy), reward_funcs=length_reward, args=args, ...)
    trainer.train()
    settings = GRPOLossSettings.from_args(args)
    for step, record in enumerate(trainer.recorded_steps):
        reference = grpo_step_reference(policy, record, trainer.policies_at_step, settings)
    ```
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .reference import float64_copy
from .trl_steps import Reference

__all__ = [
    "GRPO_LOSS_TYPES",
    "GRPOLossSettings",
    "GRPOPolicyRecorder",
    "RecordedStep",
    "grpo_step_reference",
    "step_updates",
    "token_ratios",
]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
_CLIPPED = frozenset({"grpo", "bnpo", "dr_grpo", "dapo", "luspo"})
_SEQUENCE_MEAN = frozenset({"grpo", "sapo"})
_STEP_TOKEN_MEAN = frozenset({"dapo", "cispo", "vespo"})
_RECORDED_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
GENERATED_AT = "generated_at_step"  # the column the recorder adds to each generated completion


@dataclass(frozen=True, slots=True, kw_only=True)
class GRPOLossSettings:
    """The settings a GRPO loss reads (``GRPOConfig``'s fields of the same names)."""

    loss_type: str
    max_completion_length: int
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: Literal["token", "sequence"] = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    bnpo_scope: Literal["step", "micro_batch"] = "step"

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> GRPOLossSettings:
        """The settings of a ``GRPOConfig`` (``epsilon_high`` defaults to ``epsilon``, as the docstring says)."""
        if args.beta != 0.0 or args.entropy_coef != 0.0 or args.top_entropy_quantile < 1.0:
            raise ValueError("the loss-type reference has no KL term, entropy bonus or entropy mask: beta=0 only")
        values = dict(
            loss_type=args.loss_type,
            max_completion_length=args.max_completion_length,
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
            delta=args.delta,
            importance_sampling_level=args.importance_sampling_level,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
        )
        return cls(**{**values, **overrides})


@dataclass(slots=True)
class RecordedStep:
    """One optimizer step: its index (``global_step`` before it) and the micro-batches it trained on, in order."""

    step: int
    micro_batches: list[dict[str, torch.Tensor]] = field(default_factory=list)


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


class GRPOPolicyRecorder:
    """Trainer mixin (put it first) for TRL's GRPOTrainer or GradAccGRPOTrainer: keeps ``policies_at_step`` (the
    parameters at the start of every optimizer step, and after training under the final ``global_step``),
    ``recorded_steps`` (:class:`RecordedStep`) and, on every generated completion, the step whose policy generated it
    (a ``generated_at_step`` column TRL's buffer carries along)."""

    def _snapshot(self) -> int:
        step = int(self.state.global_step)
        policies = self.__dict__.setdefault("policies_at_step", {})
        if step not in policies:
            policies[step] = _parameters(self.model)
        return step

    def _generate_and_score_completions(self, inputs):
        outputs = super()._generate_and_score_completions(inputs)
        if self.model.training:
            step = self._snapshot()
            rows = outputs["completion_ids"].size(0)
            outputs[GENERATED_AT] = torch.full(
                (rows,), step, dtype=torch.int64, device=outputs["completion_ids"].device
            )
        return outputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            step = self._snapshot()
            steps = self.__dict__.setdefault("recorded_steps", [])
            if not steps or steps[-1].step != step:
                steps.append(RecordedStep(step))
            keys = (*_RECORDED_KEYS, GENERATED_AT)
            steps[-1].micro_batches.append({k: inputs[k].detach().cpu().clone() for k in keys})
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def train(self, *args, **kwargs):
        """TRL's training, then the final parameters (under ``global_step``): the last step's update needs them."""
        output = super().train(*args, **kwargs)
        self.__dict__.setdefault("policies_at_step", {})[int(self.state.global_step)] = _parameters(self.model)
        return output


def step_updates(policies_at_step: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    """``{step: parameters at its start - parameters at the next step's start}``: minus the step's gradient under
    SGD(lr=1)."""
    steps = sorted(policies_at_step)
    return {
        s: {n: policies_at_step[s][n] - policies_at_step[nxt][n] for n in policies_at_step[s]}
        for s, nxt in zip(steps, steps[1:])
    }


def _policy(template: torch.nn.Module, parameters: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    model = float64_copy(copy.deepcopy(template))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(parameters[name].to(torch.float64))
    return model


def _completion_logps(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log pi(o_t | prompt, o_<t) for ``prompt + completion`` on its own (positions from 0, no padding)."""
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].double()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # position j predicts token j + 1
    return logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def _token_values(logp: torch.Tensor, old: torch.Tensor, advantage: float, s: GRPOLossSettings) -> torch.Tensor:
    """``v_it`` of one completion (see the module docstring)."""
    log_ratio = logp - old
    if s.importance_sampling_level == "sequence" and s.loss_type != "vespo":
        log_ratio = log_ratio.mean().expand_as(logp)
    ratio = log_ratio.exp()
    if s.loss_type in _CLIPPED:
        clipped = ratio.clamp(1 - s.epsilon_low, 1 + s.epsilon_high)
        capped = ratio if s.delta is None else ratio.clamp(max=s.delta)
        return -torch.minimum(capped * advantage, clipped * advantage)
    if s.loss_type == "cispo":
        return -ratio.clamp(max=s.epsilon_high).detach() * advantage * logp
    if s.loss_type == "sapo":
        tau = s.sapo_temperature_pos if advantage > 0 else s.sapo_temperature_neg
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantage
    if s.loss_type == "vespo":
        k, lam = (s.vespo_k_pos, s.vespo_lambda_pos) if advantage >= 0 else (s.vespo_k_neg, s.vespo_lambda_neg)
        w = (logp - old).sum().exp().detach()
        phi = torch.exp(torch.tensor(lam, dtype=torch.float64)) * w**k * torch.exp(-lam * w)
        return -phi * advantage * logp
    raise ValueError(f"no reference for loss_type {s.loss_type!r}; one of {GRPO_LOSS_TYPES}")


def _completions(
    template: torch.nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    policies_at_step: Mapping[int, Mapping[str, torch.Tensor]],
    step: int,
) -> tuple[torch.nn.Module, list[list[tuple[torch.Tensor, torch.Tensor, float]]]]:
    """The float64 policy of ``step`` and, by micro-batch, each completion's ``(log pi, log pi_old, advantage)``."""
    policy = _policy(template, policies_at_step[step])
    old_policies: dict[int, torch.nn.Module] = {}
    per_micro_batch = []
    for mb in micro_batches:
        rows = []
        for i in range(mb["completion_ids"].size(0)):
            prompt = mb["prompt_ids"][i][mb["prompt_mask"][i].bool()].tolist()
            completion = mb["completion_ids"][i][mb["completion_mask"][i].bool()].tolist()
            advantage = float(mb["advantages"][i])
            if not completion:
                empty = torch.zeros(0, dtype=torch.float64)
                rows.append((empty, empty, advantage))
                continue
            logp = _completion_logps(policy, prompt, completion)
            generated_at = int(mb[GENERATED_AT][i])
            if generated_at == step:  # generated by this very policy: pi_old = pi
                old = logp.detach()
            else:
                if generated_at not in old_policies:
                    old_policies[generated_at] = _policy(template, policies_at_step[generated_at])
                with torch.no_grad():
                    old = _completion_logps(old_policies[generated_at], prompt, completion)
            rows.append((logp, old, advantage))
        per_micro_batch.append(rows)
    return policy, per_micro_batch


def grpo_step_reference(
    template: torch.nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    policies_at_step: Mapping[int, Mapping[str, torch.Tensor]],
    step: int,
    settings: GRPOLossSettings,
) -> Reference:
    """The float64 gradient and loss of optimizer step ``step`` over ``micro_batches`` (every micro-batch of the step,
    of every process, in order), the policy ``policies_at_step[step]``, each completion's old policy
    ``policies_at_step[its generated_at_step]``. ``template``: a model of the policy's architecture whose forward was
    not replaced (the initial model, before a trainer was built on it)."""
    if settings.loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"no reference for loss_type {settings.loss_type!r}; one of {GRPO_LOSS_TYPES}")
    policy, per_micro_batch = _completions(template, micro_batches, policies_at_step, step)
    values = [
        [_token_values(logp, old, advantage, settings) if logp.numel() else logp for logp, old, advantage in rows]
        for rows in per_micro_batch
    ]
    loss = _aggregate(values, settings)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}
    return Reference(grads=grads, loss=float(loss.detach()))


def token_ratios(
    template: torch.nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    policies_at_step: Mapping[int, Mapping[str, torch.Tensor]],
    step: int,
) -> torch.Tensor:
    """Every completion token's importance ratio ``pi / pi_old`` at ``step`` (float64): how far off-policy the step
    trains."""
    with torch.no_grad():
        _, per_micro_batch = _completions(template, micro_batches, policies_at_step, step)
    ratios = [(logp - old).exp() for rows in per_micro_batch for logp, old, _ in rows]
    return torch.cat(ratios) if ratios else torch.zeros(0, dtype=torch.float64)


def _aggregate(per_micro_batch: list[list[torch.Tensor]], s: GRPOLossSettings) -> torch.Tensor:
    """The step's loss from every completion's ``v_it``: each loss type's normaliser (see the module docstring)."""
    rows = [v for values in per_micro_batch for v in values]
    zero = torch.zeros((), dtype=torch.float64)
    token_sum = sum((v.sum() for v in rows), zero)
    num_tokens = sum(v.numel() for v in rows)
    if s.loss_type in _STEP_TOKEN_MEAN or (s.loss_type == "bnpo" and s.bnpo_scope == "step"):
        return token_sum / max(num_tokens, 1)
    if s.loss_type == "bnpo":  # the mean over the micro-batches (of every process) of each one's token mean
        means = [sum((v.sum() for v in mb), zero) / max(sum(v.numel() for v in mb), 1) for mb in per_micro_batch]
        return torch.stack(means).mean()
    if s.loss_type in _SEQUENCE_MEAN:
        return torch.stack([v.mean() if v.numel() else zero for v in rows]).mean()
    if s.loss_type == "luspo":
        return torch.stack([v.sum() for v in rows]).mean()
    return token_sum / (len(rows) * s.max_completion_length)  # dr_grpo
