"""Loss curves of a few training steps: stock Trainer + GA, GradAccTrainer + GA, and one full batch per step.

Used by ``hf-gradacc check --plot``. The three runs see the same samples in the same order (a sequential
sampler), so their optimizer step k covers the same samples. The ground truth is a plain PyTorch loop that takes
each step's samples from every process as ONE batch (one forward, the loss as the user means it, one backward);
it shares no code with the Trainer, so it stays the truth on several processes, where a stock Trainer run with
GA 1 is itself wrong for most heads. The plotted value is the same for all runs: the mean loss of step k's
samples, measured in one forward pass at the parameters before step k.

matplotlib is optional (``pip install hf_gradacc[plot]``) and imported only when drawing.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from ...errors import GradAccConfigError
from ...testing.one_step import one_step_args
from ...testing.reference import full_batch_loss
from ...testing.tiny import ListDataset
from .._shared import require_matplotlib

STOCK_LABEL = "stock Trainer, GA {gas}"
GRADACC_LABEL = "GradAccTrainer, GA {gas}"
FULL_BATCH_LABEL = "one full batch per step (ground truth)"
OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd")


def _window_loss(model: torch.nn.Module, window: Sequence[dict[str, Any]], task: str, collate: Callable) -> float:
    """The mean loss of ``window`` in one forward pass, in eval mode, without touching gradients."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in collate(list(window)).items()}
    with torch.no_grad():
        loss = float(full_batch_loss(model, batch, task))
    model.train(was_training)
    return loss


class _WindowLossCallback(TrainerCallback):
    """Measures the loss of each optimizer step's samples before the step, and moves a progress bar."""

    def __init__(self, samples, window_size, task, collate, progress) -> None:
        self.samples = samples
        self.window_size = window_size
        self.task = task
        self.collate = collate
        self.progress = progress
        self.losses: list[float] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        start = state.global_step * self.window_size
        self.losses.append(
            _window_loss(model, self.samples[start : start + self.window_size], self.task, self.collate)
        )

    def on_step_end(self, args, state, control, **kwargs):
        self.progress.update(1)


def _sequential(trainer_class: type[Trainer]) -> type[Trainer]:
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    return type(f"Sequential{trainer_class.__name__}", (trainer_class,), {"_get_train_sampler": _get_train_sampler})


def _make_optimizer(model: torch.nn.Module, optimizer: str, learning_rate: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    return torch.optim.SGD(params, lr=learning_rate)


def train_loss_curves(
    model: torch.nn.Module,
    task: str,
    samples: Sequence[dict[str, Any]],
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    data_collator: Callable,
    optimizer: str = "adamw",
    learning_rate: float = 1e-3,
    seed: int = 0,
    args_overrides: dict[str, Any] | None = None,
    show_progress: bool = True,
) -> dict[str, dict[str, list[float]]]:
    """Train copies of ``model`` on ``samples`` three ways; return ``{run label: {"loss": [...], ...}}``.

    ``samples`` must hold whole optimizer steps (a multiple of batch x GA x processes); every process passes the
    same list. ``"loss"`` is the measured mean loss of each step's samples before that step (the same quantity for
    all runs); the two Trainer runs also carry ``"logged_loss"``, what the trainer itself logged for each step.
    Constant learning rate, no weight decay, no gradient clipping (it would hide a gradient that is too large).

    Example:
        ```python
        from hf_gradacc.commands.check.loss_curves import draw_loss_curves, train_loss_curves
        from hf_gradacc.testing.tiny import PaddingCollator, build_tiny_model, make_samples

        curves = train_loss_curves(build_tiny_model("masked_lm"), "masked_lm", make_samples("masked_lm", 80),
                                   per_device_train_batch_size=2, gradient_accumulation_steps=4,
                                   data_collator=PaddingCollator())
        draw_loss_curves(curves, "curves.png", title="masked LM")
        ```
    """
    from tqdm.auto import tqdm

    from ...trainer import GradAccTrainer

    if optimizer not in OPTIMIZERS:
        raise GradAccConfigError(f"`optimizer` ({optimizer!r}) must be one of {OPTIMIZERS}")
    bs, gas = per_device_train_batch_size, gradient_accumulation_steps

    def training_args() -> TrainingArguments:
        values: dict[str, Any] = dict(
            output_dir=tempfile.mkdtemp(prefix="hf_gradacc_plot_"),
            max_steps=-1,
            num_train_epochs=1,
            learning_rate=learning_rate,
            seed=seed,
            # DeepSpeed builds the optimizer from the args, not from `optimizers=`: keep both the same.
            optim="adamw_torch" if optimizer == "adamw" else "sgd",
        )
        values.update(args_overrides or {})
        return one_step_args(per_device_train_batch_size=bs, gradient_accumulation_steps=gas, **values)

    args = training_args()
    window_size = bs * gas * args.world_size
    num_steps = len(samples) // window_size
    if num_steps == 0 or len(samples) % window_size:
        raise GradAccConfigError(
            f"`samples` ({len(samples)}) must be a positive multiple of batch x GA x processes ({window_size})"
        )
    samples = list(samples)
    curves: dict[str, dict[str, list[float]]] = {}
    with tqdm(total=3 * num_steps, disable=not show_progress, file=sys.stderr, unit="step") as progress:
        for label, trainer_class in ((STOCK_LABEL, Trainer), (GRADACC_LABEL, GradAccTrainer)):
            label = label.format(gas=gas)
            progress.set_description(f"training {label}")
            run_model = copy.deepcopy(model)
            callback = _WindowLossCallback(samples, window_size, task, data_collator, progress)
            trainer = _sequential(trainer_class)(
                model=run_model,
                args=training_args(),
                train_dataset=ListDataset(samples),
                data_collator=data_collator,
                optimizers=(_make_optimizer(run_model, optimizer, learning_rate), None),
                callbacks=[callback],
            )
            trainer.train()
            logged = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
            curves[label] = {"loss": callback.losses, "logged_loss": logged}

        progress.set_description(f"training {FULL_BATCH_LABEL}")
        # Every process runs this loop alone on all samples of each step: no collective, identical results.
        run_model = copy.deepcopy(model).to(args.device)
        run_model.train()
        opt = _make_optimizer(run_model, optimizer, learning_rate)
        losses: list[float] = []
        for step in range(num_steps):
            window = samples[step * window_size : (step + 1) * window_size]
            losses.append(_window_loss(run_model, window, task, data_collator))
            batch = {k: v.to(args.device) for k, v in data_collator(window).items()}
            opt.zero_grad()
            full_batch_loss(run_model, batch, task).backward()
            opt.step()
            progress.update(1)
        curves[FULL_BATCH_LABEL] = {"loss": losses}
    return curves


def draw_loss_curves(curves: dict[str, dict[str, list[float]]], path: str, *, title: str = "") -> None:
    """Draw :func:`train_loss_curves`' result to the image ``path`` (PNG by its suffix): loss, and deviation
    from the full-batch run on a log scale.

    Example:
        ```python
        from hf_gradacc.commands.check.loss_curves import draw_loss_curves
        draw_loss_curves({"full batch, GA 1 (ground truth)": {"loss": [2.0, 1.5]}}, "curves.png")
        ```
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    styles = {
        FULL_BATCH_LABEL: dict(color="black", linewidth=4.0, alpha=0.35, zorder=1),
        "GradAccTrainer": dict(color="tab:blue", linewidth=1.6, linestyle="--", marker="o", markersize=3, zorder=3),
        "stock": dict(color="tab:red", linewidth=1.6, marker="x", markersize=4, zorder=2),
    }

    def style(label: str) -> dict[str, Any]:
        for key, value in styles.items():
            if label.startswith(key):
                return value
        return {}

    truth = curves.get(FULL_BATCH_LABEL, {}).get("loss")
    fig = Figure(figsize=(8, 6.5 if truth else 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1)) if truth else [fig.subplots()]
    for label, curve in curves.items():
        axes[0].plot(range(len(curve["loss"])), curve["loss"], label=label, **style(label))
    axes[0].set_ylabel("mean loss of the step's samples\n(before the step)")
    axes[0].legend()
    axes[0].grid(alpha=0.3)
    if title:
        axes[0].set_title(title)
    if truth:
        for label, curve in curves.items():
            if label == FULL_BATCH_LABEL:
                continue
            # Step 0 is before any update, identical for every run by construction.
            deviation = [max(abs(a - b), 1e-12) for a, b in zip(curve["loss"][1:], truth[1:])]
            axes[1].semilogy(range(1, len(deviation) + 1), deviation, label=label, **style(label))
        axes[1].set_ylabel("|loss - full batch|\n(after step 0)")
        axes[1].grid(alpha=0.3, which="both")
        axes[1].legend(fontsize="small")
    axes[-1].set_xlabel("optimizer step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(path, dpi=110)
