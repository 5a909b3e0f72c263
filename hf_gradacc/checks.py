"""The start-up consistency check: on the first micro-batch of training, the loss the library reconstructs must be the
loss the model defines.

- Built-in loss: the model is called WITH its labels on that micro-batch (one forward; it computes its own loss from
  the same logits) and ``outputs.loss`` is compared with the micro-batch's reconstruction (each term's sum over its
  own count: the head's loss, plus the router terms of :mod:`hf_gradacc.auxiliary`). A mismatch means the model adds
  something the library does not model.
- An overridden ``compute_loss`` returning a plain tensor: it is read as the micro-batch's MEAN. One extra forward
  (no gradient) gives the model's own mean; a returned value that is that mean times the world size, or divided by the
  step's global count instead of the micro-batch's, was already normalised by an inner trainer (e.g. TRL's
  ``SFTTrainer`` placed before the mixin) and would be re-weighted twice; a value that is that mean times the
  micro-batch's count is an unnormalised SUM (its gradient would be that many times too large).

Every rank records its verdict; the verdicts are agreed in one collective after the first window, so every rank stops
together. ``check_loss_at_start=False`` turns the check off.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import GradAccLossError

# How close the reconstruction must be to the model's own loss, relative: float32 sums in another order differ by
# ~1e-6. A model that computes its loss in bf16 / fp16 (e.g. on half-precision logits) rounds it: the bound is then
# twice that dtype's epsilon (bf16: 1.6%, fp16: 0.2%), still far below any term worth training.
BUILTIN_RTOL = 1e-3
# Plain losses are compared with a second forward pass (dropout may differ): a factor is named only when the returned
# value is within this of it and the candidate factors are well apart.
PLAIN_RTOL = 0.02

OK, MISMATCH, WORLD_FACTOR, GLOBAL_COUNT, GLOBAL_COUNT_AND_WORLD, UNNORMALISED_SUM = range(6)


@dataclass(frozen=True, slots=True)
class LossCheck:
    """One rank's verdict: ``code`` (0 = consistent or not checkable), the reconstructed / returned value, the model's
    own loss, and the factors involved."""

    code: int = OK
    ours: float = 0.0
    model: float = 0.0
    world_size: int = 1
    ratio: float = 1.0

    def as_tensor(self, device: torch.device | str) -> torch.Tensor:
        return torch.tensor(
            [float(self.code), self.ours, self.model, float(self.world_size), self.ratio],
            dtype=torch.float64,
            device=device,
        )

    @classmethod
    def from_row(cls, row: torch.Tensor) -> LossCheck:
        code, ours, model, world, ratio = (float(x) for x in row.tolist())
        return cls(code=int(code), ours=ours, model=model, world_size=int(world), ratio=ratio)

    def message(self, rank: int) -> str:
        where = f"rank {rank}, first micro-batch"
        if self.code == MISMATCH:
            rel = abs(self.ours - self.model) / max(abs(self.model), 1e-12)
            return (
                f"The loss hf_gradacc reconstructs for the first micro-batch ({self.ours:.6g}, {where}) differs from "
                f"the model's own loss ({self.model:.6g}) by {rel:.2%}: the model adds something the library does not "
                "model, which training would silently drop. Ways out: set `head_type` to the model's loss family; or "
                "override `compute_loss` and return every term as an hf_gradacc.LossTerm; or, if the difference is "
                "intended, set `check_loss_at_start=False`."
            )
        if self.code == UNNORMALISED_SUM:
            return (
                f"compute_loss returned {self.ours:.6g} ({where}), the micro-batch's mean loss ({self.model:.6g}) "
                "times "
                f"its {self.ratio:.0f} counted items: an unnormalised SUM. hf_gradacc reads a plain tensor as the "
                f"micro-batch's MEAN and would train a gradient ~{self.ratio:.0f}x too large. Divide the sum by "
                "`num_items_in_batch` (hf_gradacc passes this micro-batch's count), or return "
                'hf_gradacc.LossTerm(total=<sum>, normalize_by="tokens" | "samples"), or set '
                "`check_loss_at_start=False` if the value is meant."
            )
        factor = {
            WORLD_FACTOR: f"times the {self.world_size} processes",
            GLOBAL_COUNT: f"divided by the step's global count instead of the micro-batch's (x{self.ratio:.3g})",
            GLOBAL_COUNT_AND_WORLD: f"normalised by the step's global count and multiplied by the {self.world_size} "
            "processes",
        }[self.code]
        return (
            f"compute_loss returned {self.ours:.6g} ({where}), the micro-batch's mean loss ({self.model:.6g}) "
            f"{factor}: "
            "it was already normalised for accumulation (for example by TRL's SFTTrainer placed before the mixin in "
            "the bases), and hf_gradacc would weight it again. Put GradAccMixin FIRST in the bases (for TRL: use "
            "hf_gradacc.trl's GradAccSFTTrainer, GradAccDPOTrainer or GradAccRewardTrainer, which keep TRL's loss "
            "options and metrics), return hf_gradacc.LossTerm(total=<sum>, normalize_by=...), or set "
            "`check_loss_at_start=False` if the value is meant."
        )


def check_builtin(ours: float, model_loss: Any) -> LossCheck:
    """Compare the reconstruction of the built-in loss with the model's own ``outputs.loss`` (None: not checkable)."""
    if not torch.is_tensor(model_loss) or model_loss.numel() != 1:
        return LossCheck()
    model = float(model_loss.detach().float())
    if not (math.isfinite(model) and math.isfinite(ours)):
        return LossCheck()  # a non-finite step is the non-finite policy's business
    rtol = max(BUILTIN_RTOL, 2 * torch.finfo(model_loss.dtype).eps) if model_loss.is_floating_point() else BUILTIN_RTOL
    if abs(ours - model) <= rtol * max(abs(model), 1e-6):
        return LossCheck(ours=ours, model=model)
    return LossCheck(code=MISMATCH, ours=ours, model=model)


def check_plain(returned: float, model_mean: float, *, world_size: int, local: int, global_count: int) -> LossCheck:
    """Classify a plain loss against the micro-batch's own mean: consistent, or already normalised by a factor the
    mixin would apply again. Unknown ratios (a custom loss) are not judged."""
    if not (math.isfinite(returned) and math.isfinite(model_mean)) or model_mean == 0 or local == 0:
        return LossCheck()
    share = local / max(global_count, 1)
    candidates = {
        OK: 1.0,
        WORLD_FACTOR: float(world_size),
        GLOBAL_COUNT: share,
        GLOBAL_COUNT_AND_WORLD: share * world_size,
        UNNORMALISED_SUM: float(local),
    }
    ratio = returned / model_mean
    code, factor = min(candidates.items(), key=lambda kv: abs(math.log(max(ratio, 1e-12) / kv[1])))
    others = [f for c, f in candidates.items() if c != code and not math.isclose(f, factor, rel_tol=1e-9)]
    close = abs(ratio / factor - 1) <= PLAIN_RTOL
    distinct = all(abs(math.log(f / factor)) > 0.1 for f in others)
    if code == OK or not close or not distinct or ratio <= 0:
        return LossCheck(ours=returned, model=model_mean, world_size=world_size, ratio=ratio)
    return LossCheck(code=code, ours=returned, model=model_mean, world_size=world_size, ratio=ratio)


def start_up_check(
    parsed: Any,
    window: Any,
    *,
    denominator: str,
    builtin: bool,
    label_smoothing: float,
    dp_world_size: int,
    model_mean: Callable[[], float | None],
) -> LossCheck:
    """This rank's verdict on the first micro-batch. ``parsed``: what ``compute_loss`` returned (with the model's
    outputs for the built-in loss); ``model_mean``: runs the extra forward for a plain loss, only when needed."""
    counts = window.current_counts
    if builtin:
        if label_smoothing:
            return LossCheck()  # the model's own loss has no smoothing: nothing to compare with
        return check_builtin(float(parsed.batch_mean(counts).detach().float()), getattr(parsed.outputs, "loss", None))
    if parsed.plain is None or sum(window.counts.num_micro_batches_per_rank) <= 1:
        return LossCheck()  # LossTerms are explicit; with one micro-batch on one rank every factor is 1
    own = model_mean()
    if own is None:
        return LossCheck()
    return check_plain(
        float(parsed.plain.detach().float()),
        own,
        world_size=dp_world_size,
        local=counts.get(denominator),
        global_count=window.global_count(denominator),
    )


def agree(check: LossCheck, all_gather: Any, device: torch.device | str) -> None:
    """Every rank's verdict in one collective; raise :class:`~hf_gradacc.GradAccLossError` on every rank when any rank
    found an inconsistency (with the first such rank's numbers)."""
    rows = all_gather(check.as_tensor(device)).reshape(-1, 5).cpu()
    for rank in range(rows.shape[0]):
        verdict = LossCheck.from_row(rows[rank])
        if verdict.code != OK:
            raise GradAccLossError(verdict.message(rank))
