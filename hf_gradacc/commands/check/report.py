"""The text of `hf-gradacc check`'s report: the set-up, the table of one check, the table of the default run over
the heads, the notes that say why the stock trainer is off, and the summary line. Formatting only: the command
prints it.

Example:
    ```python
    from hf_gradacc.commands.check.report import summary_line
    from hf_gradacc.testing.reference import Comparison

    ours = Comparison(relative_error=3e-7, cosine=1.0, norm_ratio=1.0)
    stock = Comparison(relative_error=3.0, cosine=1.0, norm_ratio=4.0)
    summary_line(ours, stock, 1e-5)  # '... GradAccTrainer is exact (...); stock Trainer is off by 4.0x'
    ```
"""

from __future__ import annotations

import platform
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

WIDTH = 115


@dataclass(frozen=True)
class Setup:
    """What one `hf-gradacc check` ran (also the ``setup`` of its JSON)."""

    task: str
    model: str
    model_class: str
    num_parameters: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    num_samples: int
    backend: str
    device: str
    seed: int
    versions: dict[str, str]
    mesh: str = "single process"
    data_ranks: int = 0  # ranks that hold different samples, when fewer than world_size (tensor / expert ranks)


@dataclass(frozen=True, slots=True)
class HeadResult:
    """One row of the default run: the case's key and options, its model class, and both trainers' comparisons
    (``None`` with ``skipped`` set when the case could not run under this set-up)."""

    key: str
    options: str
    task: str
    model_class: str = ""
    stock: Any = None
    ours: Any = None
    skipped: str = ""


def versions() -> dict[str, str]:
    """The versions the report names."""
    import accelerate
    import torch
    import transformers

    from ... import __version__

    return {
        "hf_gradacc": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
    }


def _fill(text: str) -> str:
    return textwrap.fill(text, width=WIDTH, initial_indent="  ", subsequent_indent="  ")


def verdict(comparison: Any, tolerance: float) -> str:
    return "exact" if comparison.is_exact(tolerance) else "WRONG"


def off_by(comparison: Any) -> str:
    """How a step is off the full-batch step, in words: a scale, a small relative error, or direction and norm."""
    if abs(comparison.cosine - 1.0) < 1e-4 and abs(comparison.norm_ratio - 1.0) >= 0.05:
        return f"off by {comparison.norm_ratio:.1f}x"
    if abs(comparison.norm_ratio - 1.0) < 0.05:
        return f"off by {comparison.relative_error:.1e} (relative)"
    return f"off: cosine {comparison.cosine:.3f}, norm {comparison.norm_ratio:.2f}x"


def stock_note(stock: Any, tolerance: float, task: str, *, has_router: bool = False) -> str:
    """Why the stock Trainer's step is what it is. The router explanation only for a model with a router term."""
    if stock.is_exact(tolerance):
        return (
            "The stock Trainer is exact here too: for a causal LM with a `labels` key transformers passes "
            "num_items_in_batch to the model's loss. Other heads, an overridden compute_loss or "
            "accepts_loss_kwargs=False models break it (run `hf-gradacc check` without --task for all of them)."
            if task == "causal_lm"
            else "The stock Trainer is exact here too."
        )
    if abs(stock.cosine - 1.0) < 1e-4 and abs(stock.norm_ratio - 1.0) < 0.05:
        scale = abs(1.0 - stock.norm_ratio)
        if abs(stock.relative_error - scale) <= 0.1 * stock.relative_error:  # the error is the step's size alone
            return (
                f"The stock Trainer's step has the full-batch direction but {stock.norm_ratio:.4f}x its size: it "
                "divides the step's loss by another count than the step's counted targets (transformers 5.6 does so "
                "for causal LMs)."
            )
        if has_router:
            return (
                f"The stock Trainer's step is {stock.relative_error:.1e} off the full-batch step (relative): the "
                "model's mixture-of-experts router term is weighted per micro-batch instead of by its share of the "
                "step's routed tokens."
            )
        return (
            f"The stock Trainer's step is {stock.relative_error:.1e} off the full-batch step (relative): its "
            "micro-batches are weighted by another rule than their share of the step's counted targets."
        )
    if abs(stock.cosine - 1.0) < 1e-4:
        return (
            f"The stock Trainer's step is {stock.norm_ratio:.1f}x the full-batch step: each micro-batch's mean loss "
            f"counts fully instead of by its share of the step, as if the learning rate were {stock.norm_ratio:.0f}x."
        )
    return (
        "The stock Trainer's step points elsewhere than the full-batch step: micro-batch means are weighted "
        "equally although they hold different numbers of counted items."
    )


def router_note(logs: dict[str, float]) -> str:
    """The router term's share of the step's loss, from GradAccTrainer's first log ('' without ``loss/aux``)."""
    if "loss/aux" not in logs:
        return ""
    aux, total = logs["loss/aux"], logs["loss"]
    return _fill(
        f"router: the model's load-balancing term is {aux:.4g} of the step's loss {total:.4g} ({aux / total:.1%}); "
        "hf_gradacc weights it per micro-batch by routed tokens (logged as loss/aux)."
    )


def summary_line(
    ours: Any, stock: Any, tolerance: float, *, names: tuple[str, str] = ("GradAccTrainer", "Trainer")
) -> str:
    """The last line of one check: whether hf_gradacc's trainer is exact, and how the stock one is off."""
    ours_name, stock_name = names
    if ours.is_exact(tolerance):
        head = f"hf-gradacc check: {ours_name} is exact (rel err {ours.relative_error:.1e} <= {tolerance:g})"
    else:
        head = f"hf-gradacc check: {ours_name} is NOT exact (rel err {ours.relative_error:.1e} > {tolerance:g})"
    tail = (
        f"stock {stock_name} is exact too" if stock.is_exact(tolerance) else f"stock {stock_name} is {off_by(stock)}"
    )
    return f"{head}; {tail}"


def _setup_lines(setup: Setup, data_note: str | None) -> list[str]:
    bs, gas, world = setup.per_device_train_batch_size, setup.gradient_accumulation_steps, setup.world_size
    processes = f"{world} process" + ("es" if world != 1 else "")
    if 0 < setup.data_ranks < world:  # the tensor / expert ranks hold copies of the data ranks' samples
        processes = f"{setup.data_ranks} data rank" + ("s" if setup.data_ranks != 1 else "") + f" (of {processes})"
    versions_text = ", ".join(f"{k} {v}" for k, v in setup.versions.items() if k != "python")
    return [
        f"  batch     {bs} per device x {gas} accumulation steps x {processes} = {setup.num_samples} samples per step",
        *([f"  data      {data_note}"] if data_note else []),
        f"  backend   {setup.backend} on {setup.device}",
        f"  mesh      {setup.mesh}",
        f"  versions  {versions_text}",
    ]


def format_report(
    setup: Setup, results: dict[str, Any], tolerance: float, *, stock_note: str, data_note: str | None = None
) -> str:
    """The report of one check: the set-up, one table row per trainer, and the note on the stock trainer."""
    lines = [
        "hf-gradacc check: one accumulated optimizer step vs. the float64 full-batch gradient",
        "",
        f"  task      {setup.task}",
        f"  model     {setup.model_class} ({setup.model}, {setup.num_parameters:,} trainable parameters)",
        *_setup_lines(setup, data_note),
        "",
        f"  {'trainer':<18}{'rel. error':>12}{'cosine':>12}{'norm ratio':>12}   verdict (tolerance {tolerance:g})",
    ]
    for name, c in results.items():
        lines.append(
            f"  {name:<18}{c.relative_error:>12.2e}{c.cosine:>12.6f}{c.norm_ratio:>12.4f}   {verdict(c, tolerance)}"
        )
    lines += ["", _fill(stock_note)]
    return "\n".join(lines)


def heads_exact(rows: Sequence[HeadResult], tolerance: float) -> bool:
    """Whether GradAccTrainer is exact on every head that ran (and at least one ran)."""
    ran = [r for r in rows if r.ours is not None]
    return bool(ran) and all(r.ours.is_exact(tolerance) for r in ran)


def _stock_detail(comparison: Any) -> str:
    """How a step is off, in a table cell: its cosine and norm ratio with the full-batch step."""
    if abs(comparison.cosine - 1.0) < 1e-4:
        return f"norm {comparison.norm_ratio:.2f}x"
    return f"cosine {comparison.cosine:.3f}, norm {comparison.norm_ratio:.2f}x"


def format_heads_report(setup: Setup, rows: Sequence[HeadResult], tolerance: float) -> str:
    """The report of the default run: one row per head with the stock Trainer's and GradAccTrainer's verdict and
    relative error, the options that check the head alone, and how the stock step is off."""
    lines = [
        "hf-gradacc check: one accumulated optimizer step per head, stock Trainer and GradAccTrainer, each against "
        "the",
        "float64 gradient of one full batch of the same samples (built-in tiny models, synthetic mixed-length data)",
        "",
        *_setup_lines(setup, None),
        "",
        f"  {'head':<26}{'Trainer':<18}{'GradAccTrainer':<18}{'alone: hf-gradacc check':<32}stock step",
    ]
    for r in rows:
        if r.ours is None:
            lines.append(f"  {r.key:<26}{'skipped':<36}{r.options:<32}{r.skipped}")
            continue
        stock, ours = r.stock, r.ours
        detail = "" if stock.is_exact(tolerance) else _stock_detail(stock)
        lines.append(
            f"  {r.key:<26}{verdict(stock, tolerance):<8}{stock.relative_error:<10.1e}"
            f"{verdict(ours, tolerance):<8}{ours.relative_error:<10.1e}{r.options:<32}{detail}".rstrip()
        )
    ran = [r for r in rows if r.ours is not None]
    wrong = [r for r in ran if not r.stock.is_exact(tolerance)]
    causal_lm_wrong = any(r.key == "causal_lm" for r in wrong)
    note = (
        f"Relative gradient error of each trainer's step (tolerance {tolerance:g}): the stock Trainer is wrong on "
        f"{len(wrong)} of {len(ran)} heads. "
        + (
            "Even the plain causal LM is off: under sequence parallelism the stock Trainer computes the loss itself "
            "(transformers' Ulysses loss, each micro-batch's mean over its targets, every micro-batch weighted "
            "alike), "
            "not through num_items_in_batch. "
            if causal_lm_wrong and setup.mesh.startswith("SP")
            else "Even the plain causal LM, whose loss takes num_items_in_batch, is off with this transformers "
            "version "
            "(transformers 5.6 divides it by another count than the step's targets). "
            if causal_lm_wrong
            else "It is exact only when the model's own loss takes num_items_in_batch (a causal LM with a `labels` "
            "key that accepts loss kwargs). "
        )
        + "Elsewhere each micro-batch's mean loss counts as a whole, so padding and micro-batches of unequal size "
        "change the step. GradAccTrainer divides each micro-batch's summed loss by the step's count of targets. A "
        "row's options print its full table."
    )
    lines += ["", _fill(note)]
    return "\n".join(lines)


def heads_summary_line(rows: Sequence[HeadResult], tolerance: float) -> str:
    """The last line of the default run."""
    ran = [r for r in rows if r.ours is not None]
    if not ran:
        return "hf-gradacc check: no head could run under this set-up"
    worst = max(r.ours.relative_error for r in ran)
    wrong = sum(not r.stock.is_exact(tolerance) for r in ran)
    not_exact = [r.key for r in ran if not r.ours.is_exact(tolerance)]
    skipped = len(rows) - len(ran)
    heads = f"{len(ran)} heads" + (f" that ran ({skipped} skipped)" if skipped else "")
    if not_exact:
        head = (
            f"hf-gradacc check: GradAccTrainer is NOT exact on {', '.join(not_exact)} "
            f"(largest rel err {worst:.1e} > {tolerance:g})"
        )
    else:
        head = (
            f"hf-gradacc check: GradAccTrainer is exact on all {heads} (largest rel err {worst:.1e} <= {tolerance:g})"
        )
    return f"{head}; stock Trainer is wrong on {wrong} of {len(ran)}"
