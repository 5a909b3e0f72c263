"""Shared fixtures: one CPU thread, quiet Hugging Face output, and small helpers to train and replay steps."""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from hf_gradacc.testing.reference import reference_gradients  # noqa: E402
from hf_gradacc.testing.tiny import PaddingCollator  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_warning_once_cache():
    """hf_gradacc warns through transformers' `logger.warning_once` (once per process); each test starts afresh."""
    import logging

    logging.Logger.warning_once.cache_clear()
    yield


@pytest.fixture(autouse=True)
def _default_verbosity():
    """Each test starts at transformers' default verbosity, which hf_gradacc's loggers follow (hf_gradacc/log.py): a
    Trainer's `log_level` or the CLI's quiet mode set it for the whole process, and would hide later tests' warnings."""
    import logging

    import transformers

    transformers.utils.logging.set_verbosity_warning()
    logging.getLogger("hf_gradacc").setLevel(logging.NOTSET)
    yield


@pytest.fixture(autouse=True, scope="session")
def _quiet_single_thread():
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    yield


def trainable_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached float32 CPU copy of every trainable parameter, by name."""
    return {n: p.detach().clone().cpu().float() for n, p in model.named_parameters() if p.requires_grad}


class ParamSnapshots(TrainerCallback):
    """Copies the trainable parameters at the start of training and after every optimizer step."""

    def __init__(self) -> None:
        self.snapshots: list[dict[str, torch.Tensor]] = []
        self.num_optimizer_steps = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.snapshots.append(trainable_params(model))

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.num_optimizer_steps += 1

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.snapshots.append(trainable_params(model))


@dataclass
class TrainRun:
    trainer: Trainer
    snapshots: list[dict[str, torch.Tensor]] = field(default_factory=list)
    num_optimizer_steps: int = 0

    def update(self, step: int) -> dict[str, torch.Tensor]:
        """``params before step - params after step`` for the 1-based optimizer ``step`` (= the gradient at lr 1)."""
        before, after = self.snapshots[step - 1], self.snapshots[step]
        return {n: before[n] - after[n] for n in before}

    @property
    def logs(self) -> list[dict[str, Any]]:
        return [h for h in self.trainer.state.log_history if "loss" in h]


def make_args(**overrides: Any) -> TrainingArguments:
    """Quiet CPU `TrainingArguments` (or ``args_class``) for short runs."""
    args_class = overrides.pop("args_class", TrainingArguments)
    kwargs: dict[str, Any] = dict(
        output_dir=tempfile.mkdtemp(prefix="hf_gradacc_test_"),
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=True,
        dataloader_drop_last=False,
    )
    kwargs.update(overrides)
    return args_class(**kwargs)


def run_training(
    trainer_class: type[Trainer],
    model: torch.nn.Module,
    train_dataset: Any,
    args: TrainingArguments,
    *,
    sgd_lr: float | None = None,
    data_collator: Callable | None = None,
    **trainer_kwargs: Any,
) -> TrainRun:
    """Train a deep copy of ``model``; with ``sgd_lr`` the optimizer is plain SGD at that (constant) rate."""
    model = copy.deepcopy(model)
    snapshots = ParamSnapshots()
    optimizers = (None, None)
    if sgd_lr is not None:
        optimizers = (torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=sgd_lr), None)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=train_dataset,
        data_collator=data_collator or PaddingCollator(),
        optimizers=optimizers,
        callbacks=[snapshots],
        **trainer_kwargs,
    )
    trainer.train()
    return TrainRun(trainer, snapshots.snapshots, snapshots.num_optimizer_steps)


def reference_at(
    model: torch.nn.Module,
    params: dict[str, torch.Tensor],
    samples: Sequence[dict[str, Any]],
    task: str,
) -> dict[str, torch.Tensor]:
    """Float64 full-batch gradient over ``samples`` of ``model`` with its trainable parameters set to ``params``."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in params:
                p.copy_(params[name])
    return reference_gradients(model, samples, task, PaddingCollator())


def sequential(trainer_class: type[Trainer]) -> type[Trainer]:
    """``trainer_class`` with the training samples taken in dataset order (no shuffling)."""

    class Sequential(trainer_class):  # type: ignore[misc, valid-type]
        def _get_train_sampler(self, train_dataset=None):
            dataset = train_dataset if train_dataset is not None else self.train_dataset
            return torch.utils.data.SequentialSampler(dataset)

    Sequential.__name__ = f"Sequential{trainer_class.__name__}"
    Sequential.__qualname__ = Sequential.__name__
    return Sequential


class Helpers:
    """The helpers above, handed to tests by the ``helpers`` fixture."""

    make_args = staticmethod(make_args)
    run_training = staticmethod(run_training)
    reference_at = staticmethod(reference_at)
    sequential = staticmethod(sequential)
    trainable_params = staticmethod(trainable_params)


@pytest.fixture
def helpers() -> Helpers:
    """Training and replay helpers shared by the unit tests."""
    return Helpers()
