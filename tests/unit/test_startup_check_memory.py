"""The start-up loss check costs no memory: on the first micro-batch the model computes its own loss without a graph
(its ``loss_function`` under no_grad; an inline loss's graph is dropped right after the forward), so at no moment
are two sets of [tokens x vocabulary] tensors saved for backward, as with the check off and as in the stock Trainer.

Measured without timing or memory readings: saved-tensor hooks box every logit-sized tensor autograd saves, and a
finalizer on each box tells when the graph that holds it is freed; the test takes the most such tensors alive at
once over one training step."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch

import hf_gradacc.builtin_loss as builtin_loss_module
from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import VOCAB_SIZE, build_tiny_model, make_samples

HIDDEN = 32
# Every micro-batch has more positions than the hidden size, so a logit-sized tensor (positions x vocabulary) is
# larger than any weight-sized one (the head's weight, hidden x vocabulary, is saved too).
MIN_LENGTH = 2 * HIDDEN


class _Box:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class LiveLogitSizedSaves:
    """Saved-tensor hooks that track the logit-sized tensors autograd holds: ``peak`` is the most distinct storages
    alive at once."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.live: dict[int, int] = {}  # box id -> storage pointer
        self.peak = 0
        self.num_saved = 0

    def _is_logit_sized(self, tensor: torch.Tensor) -> bool:
        return tensor.dim() >= 2 and tensor.shape[-1] == self.vocab_size and tensor.numel() > self.vocab_size * HIDDEN

    def pack(self, tensor: torch.Tensor):
        if not self._is_logit_sized(tensor):
            return tensor
        box = _Box(tensor.detach())  # detached: a saved OUTPUT would otherwise hold its own node alive (a cycle)
        self.live[id(box)] = tensor.untyped_storage().data_ptr()
        weakref.finalize(box, self.live.pop, id(box), None)
        self.num_saved += 1
        self.peak = max(self.peak, len(set(self.live.values())))
        return box

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Box) else packed

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _peak_live_saves(task: str, *, check: bool) -> tuple[int, int, dict, torch.nn.Module, list]:
    model = build_tiny_model(task, hidden_size=HIDDEN)
    samples = make_samples(task, 4, seed=1, min_length=MIN_LENGTH, max_length=MIN_LENGTH + 8)
    args = one_step_args(
        per_device_train_batch_size=2, gradient_accumulation_steps=2, args_class=GradAccConfig,
        check_loss_at_start=check,
    )  # fmt: skip
    probe = LiveLogitSizedSaves(VOCAB_SIZE)
    with probe.hooks():
        update, _ = one_step_update(GradAccTrainer, model, samples, args)
    return probe.peak, probe.num_saved, update, model, samples


@pytest.mark.parametrize("task", ["causal_lm", "masked_lm"])  # loss_function (Llama) and an inline loss (BERT)
def test_the_start_up_check_keeps_one_set_of_logit_sized_saves(task: str) -> None:
    peak_on, saved_on, update, model, samples = _peak_live_saves(task, check=True)
    peak_off, _, _, _, _ = _peak_live_saves(task, check=False)
    assert peak_off == 1  # the library's cross-entropy: its log-probabilities
    assert peak_on == peak_off
    assert compare_with_reference(update, model, samples, task).relative_error <= 1e-5
    if task == "causal_lm":  # its loss_function ran without a graph: nothing was even saved for it
        _, saved_off, _, _, _ = _peak_live_saves(task, check=False)
        assert saved_on == saved_off


def test_the_probe_sees_a_second_loss_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measure can fail: with the model's loss computed WITH its graph (as before), two sets are alive."""
    monkeypatch.setattr(builtin_loss_module, "loss_function_without_graph", lambda model: contextlib.nullcontext())
    monkeypatch.setattr(builtin_loss_module, "drop_model_loss_graph", lambda outputs: None)
    peak_on, _, _, _, _ = _peak_live_saves("causal_lm", check=True)
    assert peak_on == 2


def test_the_model_loss_function_is_restored() -> None:
    model = build_tiny_model("causal_lm")
    original = model.loss_function
    assert "_loss_function" not in model.__dict__
    with builtin_loss_module.loss_function_without_graph(model):
        assert model.loss_function is not original
        logits = torch.randn(2, 5, VOCAB_SIZE, requires_grad=True)
        labels = torch.randint(0, VOCAB_SIZE, (2, 5))
        loss = model.loss_function(logits, labels, VOCAB_SIZE)
        assert not loss.requires_grad
        assert torch.allclose(loss, original(logits, labels, VOCAB_SIZE))
    assert "_loss_function" not in model.__dict__ and model.loss_function is original



@pytest.mark.parametrize("check", [True, False])
def test_no_logits_are_alive_during_the_backward_pass(check: bool) -> None:
    """The stock Trainer frees the logits after the forward (its cross-entropy saves the log-probabilities only); the
    start-up check's outputs must not keep them through the first micro-batch's backward pass either."""
    model = build_tiny_model("causal_lm", hidden_size=HIDDEN)
    samples = make_samples("causal_lm", 4, seed=1, min_length=MIN_LENGTH, max_length=MIN_LENGTH + 8)
    args = one_step_args(
        per_device_train_batch_size=2, gradient_accumulation_steps=2, args_class=GradAccConfig,
        check_loss_at_start=check,
    )  # fmt: skip
    logits: list[weakref.ref] = []
    alive_in_backward: list[bool] = []

    class Probe(GradAccTrainer):
        def create_optimizer(self, *args, **kwargs):
            head = self.model.get_output_embeddings()
            head.register_forward_hook(lambda _m, _a, out: logits.append(weakref.ref(out)))
            head.weight.register_hook(lambda grad: alive_in_backward.append(logits[-1]() is not None))
            return super().create_optimizer(*args, **kwargs)

    one_step_update(Probe, model, samples, args)
    assert alive_in_backward == [False, False]
