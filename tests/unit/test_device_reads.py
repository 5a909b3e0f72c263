"""The library reads no device value per micro-batch (issue 37): a read of a tensor's value on the host (``.item()``,
``bool()``, ``int()``, ``.tolist()``, ``.cpu()``) waits for the device, and on a GPU each one stalls the step.

Simulated on CPU: every tensor of a micro-batch leaves ``_prepare_inputs`` as a :class:`DeviceResident` tensor (a
subclass whose results stay of the subclass), and every read of such a value is recorded with the frame that asked
for it. The reads that hf_gradacc's own code asked for, per optimizer step, must be at most one (the step's counts
reach the host once, with the step's one collective); the model's and the Trainer's own reads are not ours.

A second variant marks the batches where the dataloader yields them (:class:`ResidentCollator`), as accelerate's
prepared dataloader does on a GPU: the step's micro-batches are on the device before the window counts them, so the
counts and the label checks must stay on the device until the step's one transfer (the count gather).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.counting import Counter as CountCounter
from hf_gradacc.errors import GradAccDataError
from hf_gradacc.heads import Head
from hf_gradacc.step.window import Window
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


class ResidentCollator(PaddingCollator):
    """The batches as a dataloader on an accelerator yields them: every tensor device-resident from the fetch on
    (``edit``: a change to the batch first, e.g. a planted bad label)."""

    def __init__(self, edit=None) -> None:
        self.edit = edit

    def __call__(self, samples):
        batch = super().__call__(samples)
        if self.edit is not None:
            self.edit(batch)
        return _resident(batch)


def _run(task: str, *, steps: int = 2, fetched: bool = False, collator=None, **gradacc) -> Counter:
    """Train ``steps`` optimizer steps at GA 4; the reads hf_gradacc's own code asked for. The batches are marked
    after ``_prepare_inputs``, or with ``fetched`` where the dataloader yields them (``collator``: a
    :class:`ResidentCollator`)."""
    samples = make_samples(task, 8 * steps, seed=4)
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         max_steps=steps, **gradacc)
    collator = collator or (ResidentCollator() if fetched else PaddingCollator())
    trainer = GradAccTrainer(model=build_tiny_model(task), args=args, train_dataset=ListDataset(samples),
                             data_collator=collator)
    if not fetched:
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


# ---------------------------------------------------------------------------------------------- from the dataloader
STEP_TRANSFER = "hf_gradacc:counting:gather_window_counts:"  # the step's counts reach the host: its one read


@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
def test_the_library_reads_one_device_value_per_step_when_the_dataloader_yields_device_tensors(task):
    """GA 4, the batches device-resident from the fetch: every count and label check stays on the device until the
    step's count gather, which reads them all at once (measured before: 16 reads per step, 4 per micro-batch)."""
    steps = 3
    ours = _run(task, steps=steps, fetched=True)
    per_step = {who: n for who, n in ours.items() if not who.startswith(ONCE_PER_RUN)}
    assert sum(per_step.values()) <= steps, ours  # at most one per optimizer step, none per micro-batch
    assert all(who.startswith(STEP_TRANSFER) for who in per_step), ours  # and that one is the count gather
    assert sum(ours.values()) - sum(per_step.values()) <= 2, ours  # the start-up check's two values, once


def test_the_read_counter_sees_a_count_read_per_fetched_micro_batch(monkeypatch):
    """Planted: the counter reading the micro-batch's attended tokens at once (``int(mask.sum())``, as it did) is
    seen: one read per micro-batch."""
    from hf_gradacc import counting

    original = counting.Counter.count_batch

    def reading(self, batch, *, deferred=False):
        counts = original(self, batch, deferred=deferred)
        return counting.replace(counts, num_input_tokens=counting.input_token_count(batch))

    monkeypatch.setattr(counting.Counter, "count_batch", reading)
    ours = _run("causal_lm", steps=1, fetched=True)
    assert sum(n for who, n in ours.items() if who.startswith("hf_gradacc:counting:input")) == 4, ours  # GA 4


def _bad_label(batch):
    batch["labels"][1, -1] = 10_000


def _unattended_row(batch):
    batch["attention_mask"][0] = 0  # row 0 attends to nothing, its labels still count


def test_a_label_id_out_of_range_on_the_device_raises_at_the_step_with_its_value():
    """The range check, deferred to the step's transfer, raises the same error naming the id (read only then)."""
    with pytest.raises(GradAccDataError, match=r"holds the id 10000, outside \[0, 96\)"):
        _run("causal_lm", steps=1, fetched=True, collator=ResidentCollator(_bad_label))


def test_an_unattended_row_on_the_device_is_warned_about_at_the_step(caplog):
    """The unattended-row check, deferred to the step's transfer, warns naming the row."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            _run("causal_lm", steps=1, fetched=True, collator=ResidentCollator(_unattended_row))
    finally:
        hf_logging.disable_propagation()
    assert "Row(s) [0] of a micro-batch have an `attention_mask` of all zeros" in caplog.text, caplog.text


def test_a_deferred_label_error_on_one_rank_stops_every_rank_at_the_count_gather():
    """Rank 1 alone holds a refused id (in its second micro-batch): the finding travels in the step's count gather,
    so rank 1 raises its own error naming the id and rank 0 one naming rank 1, from the same collective."""
    model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", 8, seed=4)
    good, bad = ResidentCollator(), ResidentCollator(_bad_label)
    collators = [[good, good, good, good], [good, bad, good, good]]  # per rank, per micro-batch
    slots, barrier = [None, None], threading.Barrier(2, timeout=60)
    errors: list[BaseException | None] = [None, None]

    def all_gather(rank, tensor):
        slots[rank] = tensor.detach().clone()
        barrier.wait()
        out = torch.stack(slots)
        barrier.wait()
        return out

    def rank(r):
        counter = CountCounter(Head.for_model(model))
        batches = [collate(samples[2 * i : 2 * i + 2]) for i, collate in enumerate(collators[r])]
        try:
            Window.prefetched(batches, count=partial(counter.count, deferred=True), recheck=counter.count,
                              all_gather=partial(all_gather, r), device="cpu", dp_world_size=2)  # fmt: skip
        except BaseException as error:  # noqa: BLE001 - handed back to the main thread
            errors[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert isinstance(errors[1], GradAccDataError) and "holds the id 10000" in str(errors[1]), errors
    assert isinstance(errors[0], GradAccDataError) and "Rank(s) [1]" in str(errors[0]), errors


def test_the_non_finite_verdict_is_one_read_and_keeps_this_ranks_own():
    """The step's flags (`agreed_flags`): this rank's non-finite flag and the sums over ranks (with the preemption
    flag of `save_on_preemption` or without) in ONE read, this rank's flag kept apart from the sum (the backend's
    all-reduce sums in place)."""
    from hf_gradacc.step.nonfinite import agreed_flags

    def another_rank_is_not_finite(flag):  # sum_over_processes on 2 ranks: in place, the other rank's flag added
        return flag.add_(1.0)

    DeviceResident.reads = Counter()
    norm = torch.tensor(2.0).as_subclass(DeviceResident)
    assert agreed_flags(norm, agree=another_rank_is_not_finite) == (True, False, 0)
    assert sum(DeviceResident.reads.values()) == 1, DeviceResident.reads
    DeviceResident.reads = Counter()
    assert agreed_flags(norm, agree=another_rank_is_not_finite, signalled=True) == (True, False, 2)
    assert sum(DeviceResident.reads.values()) == 1, DeviceResident.reads
