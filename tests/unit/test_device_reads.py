"""The library reads no device value per micro-batch (issue 37): a read of a tensor's value on the host (``.item()``,
``bool()``, ``int()``, ``.tolist()``, ``.cpu()``) waits for the device, and on a GPU each one stalls the step.

Simulated on CPU: every tensor of a micro-batch leaves ``_prepare_inputs`` as a :class:`DeviceResident` tensor (a
subclass whose results stay of the subclass), and every read of such a value is recorded with the frame that asked
for it. The reads that hf_gradacc's own code asked for, per optimizer step, must be at most one (the step's counts
reach the host once, with the step's one collective); the model's and the Trainer's own reads are not ours.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

PACKAGE = str(Path(__file__).resolve().parents[2] / "hf_gradacc")
READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


class DeviceResident(torch.Tensor):
    """A tensor that stands for one on an accelerator: reading its value on the host is recorded."""

    reads: Counter = Counter()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in READS:
            cls.reads[_asker()] += 1
        return super().__torch_function__(func, types, args, kwargs or {})


TORCH = str(Path(torch.__file__).parent)


def _asker() -> str:
    """Who asked for the read: the innermost frame outside torch itself. ``hf_gradacc:<module>:<function>:<line>``
    when that is the package's own code (its testing fixtures aside), ``other`` (the model, the Trainer) otherwise."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "other"
    path = frame.f_code.co_filename
    if path.startswith(PACKAGE) and "/testing/" not in path:
        return f"hf_gradacc:{Path(path).stem}:{frame.f_code.co_name}:{frame.f_lineno}"
    return "other"


def _resident(value):
    if torch.is_tensor(value):
        return value.as_subclass(DeviceResident)
    if isinstance(value, dict):
        return {k: _resident(v) for k, v in value.items()}
    return value


def _run(task: str, *, steps: int = 2, **gradacc) -> Counter:
    samples = make_samples(task, 8 * steps, seed=4)
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         max_steps=steps, **gradacc)
    trainer = GradAccTrainer(model=build_tiny_model(task), args=args, train_dataset=ListDataset(samples),
                             data_collator=PaddingCollator())
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda inputs: _resident(prepare(inputs))
    DeviceResident.reads = Counter()
    trainer.train()
    assert trainer.state.global_step == steps
    return Counter({who: n for who, n in DeviceResident.reads.items() if who.startswith("hf_gradacc")})


# Once per run, not per step: the start-up check compares the first micro-batch's loss with the model's own.
ONCE_PER_RUN = ("hf_gradacc:checks:",)


@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
def test_the_library_reads_no_device_value_per_micro_batch(task):
    steps = 3
    ours = _run(task, steps=steps)
    per_step = {who: n for who, n in ours.items() if not who.startswith(ONCE_PER_RUN)}
    assert sum(per_step.values()) <= steps, ours  # at most one per optimizer step, none per micro-batch
    assert sum(ours.values()) - sum(per_step.values()) <= 2, ours  # the start-up check's two values, once


def test_the_read_counter_sees_a_read_per_micro_batch(monkeypatch):
    """Planted: the built-in loss counting the micro-batch's input tokens itself (a read per micro-batch, the read
    this test was written for) is seen."""
    from hf_gradacc.step import engine

    original = engine.StepEngine.builtin_loss

    def recounting(self, model, inputs, return_outputs):
        from hf_gradacc.counting import input_token_count

        input_token_count(inputs)
        return original(self, model, inputs, return_outputs)

    monkeypatch.setattr(engine.StepEngine, "builtin_loss", recounting)
    ours = _run("causal_lm", steps=1)
    assert sum(ours.values()) >= 4, ours  # GA 4: one per micro-batch
