"""Record every optimizer step of a multi-step run and check each against its own float64 reference.

:class:`StepRecorder` (a callback) keeps, for each optimizer step: the samples of its window over every rank, the
parameters before the step and the full accumulated gradient (both gathered whole on sharded backends, a
collective run on every rank alike), the learning rate the step used and what was logged. :func:`check_steps` then
compares each step's gradient with the gradient of the full-batch loss over that step's samples at those
parameters, computed in float64 by :mod:`hf_gradacc.testing.reference`, which shares no code with the trainer.

This is how steps whose windows differ (an accumulation schedule, the short last window of an epoch) are shown
exact one by one, on any backend.

Example:
    ```python
    recorder = StepRecorder(samples)
    trainer = GradAccTrainer(model=model, args=args, train_dataset=ListDataset(samples),
                             data_collator=PaddingCollator(), callbacks=[recorder])
    trainer.train()
    comparisons = check_steps(recorder.all_ranks(), model, samples, "causal_lm")
    assert max(c.relative_error for c in comparisons) <= 1e-5
    ```
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..callbacks.callback import GradAccCallback
from .reference import Comparison, compare, reference_gradients
from .tiny import PaddingCollator


@dataclass
class RecordedStep:
    """One optimizer step as the trainer ran it.

    Attributes:
        step: the ``global_step`` before the step (0-based).
        micro_batches: micro-batches per rank of the step (this rank).
        samples: indices (into the run's samples) of the step's samples: this rank's, or every rank's after
            :meth:`StepRecorder.all_ranks`.
        params / grads: every trainable parameter before the step and its full accumulated gradient (CPU, float32).
        learning_rate: the rate the step used, as the trainer logs it (``lr_scaling`` included).
    """

    step: int
    micro_batches: int
    samples: list[int]
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    learning_rate: float | None = None


class StepRecorder(GradAccCallback):
    """Records each optimizer step of a GradAccTrainer (see the module docstring); ``samples`` are the run's
    samples, matched to the micro-batches by their unpadded ``input_ids`` (which must be unique)."""

    def __init__(self, samples: Sequence[dict[str, Any]], *, main_input: str = "input_ids") -> None:
        self.index = {tuple(s[main_input]): k for k, s in enumerate(samples)}
        if len(self.index) != len(samples):
            raise ValueError("StepRecorder matches samples by their input ids: they must be unique")
        self.main_input = main_input
        self.steps: list[RecordedStep] = []
        self._pending: RecordedStep | None = None

    def on_window_counted(self, args, state, control, window=None, **kwargs):
        ids: list[int] = []
        for batch in window.micro_batches:
            rows = batch[self.main_input].cpu()
            lengths = (
                batch["attention_mask"].sum(-1).tolist() if "attention_mask" in batch else [rows.shape[-1]] * len(rows)
            )
            ids.extend(self.index[tuple(row[:n].tolist())] for row, n in zip(rows, lengths))
        self._pending = RecordedStep(step=state.global_step, micro_batches=window.num_micro_batches, samples=ids)

    def on_accumulated_grads(self, args, state, control, **kwargs):
        trainer = self._require_trainer()
        record, self._pending = self._pending, None
        assert record is not None and record.step == state.global_step
        names = [n for n, _ in trainer.grads.named_parameters()]
        record.grads = {n: trainer.grads.full(n).detach().float().cpu().clone() for n in names}  # a collective each
        full = trainer.backend.full_parameters(trainer.model_wrapped)  # a collective on sharded backends
        record.params = {n: full[n].detach().float().cpu().clone() for n in names}
        self.steps.append(record)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "learning_rate" in logs and self.steps and self.steps[-1].learning_rate is None:
            self.steps[-1].learning_rate = float(logs["learning_rate"])

    def all_ranks(self) -> list[RecordedStep]:
        """The steps with ``samples`` over every rank (a collective when a process group is up; call on every rank)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.steps
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [s.samples for s in self.steps])
        merged = []
        for k, step in enumerate(self.steps):
            merged.append(copy.copy(step))
            merged[-1].samples = [i for rank_steps in gathered for i in rank_steps[k]]
        return merged


def check_steps(
    steps: Sequence[RecordedStep],
    model: torch.nn.Module,
    samples: Sequence[dict[str, Any]],
    task: str,
    *,
    collate: Callable | None = None,
    ignore_index: int = -100,
) -> list[Comparison]:
    """Each recorded step's gradient against the float64 gradient of the full-batch loss over its own samples, at
    the parameters the step started from (loaded into a copy of ``model``)."""
    comparisons = []
    for step in steps:
        at_step = copy.deepcopy(model)
        with torch.no_grad():
            for name, param in at_step.named_parameters():
                if name in step.params:
                    param.copy_(step.params[name])
        reference = reference_gradients(
            at_step, [samples[i] for i in step.samples], task, collate or PaddingCollator(), ignore_index
        )
        comparisons.append(compare(step.grads, reference))
    return comparisons
