"""``trainer.training_step`` / ``trainer.backward`` called outside ``trainer.train()`` (issue 36): the
GradAccUsageError names the way out, and the way out it names for a one-off forward and backward pass
(``trainer.compute_loss(trainer.model, batch)``, then ``loss.backward()``) is the batch's mean-loss gradient.

Measured (CPU, float32): the named way out's gradient is 1.9e-07 off the float64 mean loss of the batch; the stock
``transformers.Trainer.training_step(trainer, ...)`` raises AttributeError (``current_gradient_accumulation_steps``)
before ``train()`` and divides by ``gradient_accumulation_steps`` after it, so the message warns against it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import TrainerCallback

from hf_gradacc import GradAccConfig, GradAccTrainer, GradAccUsageError
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.reference import compare
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

TOL = 1e-5


def tiny_trainer(tmp_path, callbacks=None) -> tuple[GradAccTrainer, torch.nn.Module, list]:
    model = build_tiny_model("causal_lm", seed=0)
    samples = make_samples("causal_lm", 8)
    args = one_step_args(str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         args_class=GradAccConfig)  # fmt: skip
    trainer = GradAccTrainer(model=copy.deepcopy(model), args=args, train_dataset=ListDataset(samples),
                             data_collator=PaddingCollator(), callbacks=callbacks)  # fmt: skip
    return trainer, model, samples


def test_training_step_outside_train_names_the_way_out_and_the_way_out_works(tmp_path) -> None:
    trainer, model, samples = tiny_trainer(tmp_path)
    batch = PaddingCollator()(samples[:4])
    with pytest.raises(GradAccUsageError) as caught:
        trainer.training_step(trainer.model, batch)
    message = str(caught.value)
    assert "called outside `trainer.train()`" in message
    assert "call `trainer.train()`" in message
    assert "trainer.compute_loss(trainer.model, batch)" in message and "loss.backward()" in message
    assert "trainer.evaluate()" in message and "transformers.Trainer.training_step" in message
    # The way out it names: the batch's mean loss, its gradient that of the float64 mean loss.
    loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(batch))
    loss.backward()
    reference = copy.deepcopy(model).double()
    reference(**batch).loss.backward()
    error = compare({n: p.grad for n, p in trainer.model.named_parameters()},
                    {n: p.grad for n, p in reference.named_parameters()}).relative_error  # fmt: skip
    print(f"compute_loss + backward outside train(): relative error {error:.3g}")
    assert error <= TOL


def test_backward_outside_train_names_the_way_out(tmp_path) -> None:
    trainer, _, _ = tiny_trainer(tmp_path)
    with pytest.raises(GradAccUsageError, match=r"outside `trainer.train\(\)`.*training_step` override.*"
                                                r"call `loss.backward\(\)` on your loss"):  # fmt: skip
        trainer.backward(torch.ones((), requires_grad=True), final=True)


class CallsTrainingStep(TrainerCallback):
    """Calls ``trainer.training_step`` between two micro-batches (``on_substep_end``), keeps the error."""

    def __init__(self) -> None:
        self.trainer: GradAccTrainer | None = None
        self.errors: list[Exception] = []

    def on_substep_end(self, args, state, control, **kwargs):
        try:
            self.trainer.training_step(self.trainer.model, {})
        except GradAccUsageError as error:
            self.errors.append(error)


def test_training_step_between_micro_batches_says_so(tmp_path) -> None:
    callback = CallsTrainingStep()
    trainer, _, _ = tiny_trainer(tmp_path, callbacks=[callback])
    callback.trainer = trainer
    trainer.train()
    assert len(callback.errors) == 1
    assert "called between two micro-batches" in str(callback.errors[0])
    assert "call `trainer.train()`" in str(callback.errors[0])
