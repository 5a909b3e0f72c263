"""The fused LM head under ``torch.compile`` (issue 36): traced by dynamo, its tiles' gradients were lost and every
parameter got a zero gradient, silently. Now the fused head is never traced (``torch.compiler.disable``: it runs
eagerly between the compiled parts, exact); automatic (``fused_lm_head=None``) is off wherever torch.compile traces the
model, decided at construction and logged with the reason; ``fused_lm_head=True`` runs on one process and is refused on
several; a ``.grad`` write made by an object whose set-up never ran raises at the next fused forward."""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.nn as nn
import transformers as tf

import hf_gradacc.fused.choice as fused_choice
from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccTrainer, GradAccUsageError
from hf_gradacc.fused import into_grad
from hf_gradacc.fused.choice import check_fused_setting, compile_setting
from hf_gradacc.fused.head import fused_causal_lm_sum, fused_cross_entropy_sum
from hf_gradacc.fused.into_grad import compiled_part
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator

TOLERANCE = 1e-5
LARGE_VOCAB = 8192  # the cost model turns the fused head on here (tests/unit/test_fused_choice.py)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    into_grad.STATS = into_grad.IntoGradStats()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _ToyLM(nn.Module):
    """A causal LM in three layers (dynamo traces it in a second): embedding, one block, an output layer."""

    def __init__(self, vocab: int = 300, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.block = nn.Embedding(vocab, hidden), nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.lm_head(torch.tanh(self.block(self.embed(input_ids))))}


def _toy_batches(vocab: int = 300) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):  # GA 2: the second micro-batch writes into the existing .grad (fused_into_grad)
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        targets = ids.roll(-1, 1)
        targets[:, :5] = -100  # a prompt
        targets[:, -1] = -100
        batches.append((ids, targets))
    return batches


def _toy_grads(model: nn.Module, called: nn.Module, fused: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for ids, targets in _toy_batches():
        if fused:
            loss = fused_causal_lm_sum(called, {"input_ids": ids}, targets).sum_loss
        else:
            logits = called(input_ids=ids)["logits"]
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        (loss * 0.05).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_fused_head_inside_a_compiled_model_is_exact(backend: str) -> None:
    """``torch.compile(model)`` (dynamo with and without AOTAutograd) around the fused head: every parameter's
    gradient equals the uncompiled full logits', the second micro-batch writing into ``.grad`` as without compile."""
    model = _ToyLM()
    expected = _toy_grads(model, model, fused=False)
    got = _toy_grads(model, torch.compile(model, backend=backend), fused=True)
    assert into_grad.STATS.written == 1, into_grad.STATS
    for name, exact in expected.items():
        assert float(exact.norm()) > 0, name
        error = float((got[name] - exact).norm() / exact.norm())
        assert error <= 1e-6, (name, error)


def test_fused_cross_entropy_sum_called_from_compiled_code_is_exact() -> None:
    """Two micro-batches through a compiled function that calls the fused sum (the second writes into ``.grad``)."""
    head = nn.Linear(16, 300, bias=False)
    hidden = torch.randn(20, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    targets = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(2))

    def loss_of(rows: torch.Tensor) -> torch.Tensor:
        return fused_cross_entropy_sum(torch.tanh(rows), head.forward, targets, tile_rows=8) * 0.5

    def full_logits(rows: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(head(torch.tanh(rows)), targets, reduction="sum") * 0.5

    def grads(fn) -> tuple[torch.Tensor, torch.Tensor]:
        hidden.grad = head.weight.grad = None
        for _ in range(2):
            fn(hidden).backward()
        return hidden.grad.clone(), head.weight.grad.clone()

    expected = grads(full_logits)
    got = grads(torch.compile(loss_of, backend="aot_eager"))
    assert into_grad.STATS.written == 1, into_grad.STATS
    for ours, exact in zip(got, expected):
        assert float((ours - exact).norm() / exact.norm()) <= 1e-6


def test_compiled_parts_are_found_however_the_model_was_compiled() -> None:
    model = _ToyLM()
    assert compiled_part(model) is None
    assert "OptimizedModule" in compiled_part(torch.compile(model, backend="eager"))
    inner = _ToyLM()
    inner.block = torch.compile(inner.block, backend="eager")
    assert "`block`" in compiled_part(inner)
    in_place = _ToyLM()
    in_place.compile(backend="eager")
    assert "in place" in compiled_part(in_place)
    own = _ToyLM()
    own.forward = torch.compile(own.forward, backend="eager")
    assert "`forward`" in compiled_part(own)


def test_automatic_is_off_for_a_model_compiled_after_construction() -> None:
    """The first optimizer step's decision looks at the model as the step calls it (accelerate compiles it there)."""
    choice = fused_choice.decide(None, model=None, head=None, args=types.SimpleNamespace(process_index=0),
                                 wrapped=torch.compile(_ToyLM(), backend="eager"))
    assert not choice.enabled and "OptimizedModule" in choice.reason and "outside the compiled graph" in choice.reason


def _fused_true_setting(world: int) -> dict:
    """What the construction's check of ``fused_lm_head=True`` takes, under ``torch_compile=True`` on ``world``
    processes."""
    from hf_gradacc.backends.mesh import Mesh
    from hf_gradacc.step.engine import LossSource

    args = types.SimpleNamespace(torch_compile=True, torch_compile_backend="inductor")
    model = tf.LlamaForCausalLM(_llama_config())
    return dict(
        model=model, head_type="causal_lm", source=LossSource(), trainer_name="GradAccTrainer",
        backend=types.SimpleNamespace(mesh=Mesh.of({"dp_replicate": world}), model_parallelism=None),
        compiled=compile_setting(args=args, accelerator=None, model=model),
    )


def test_true_under_compile_is_refused_on_several_processes_and_runs_on_one() -> None:
    with pytest.raises(GradAccConfigError, match=r"fused_lm_head=True.*torch_compile=True.*several processes"):
        check_fused_setting(**_fused_true_setting(world=2))
    check_fused_setting(**_fused_true_setting(world=1))  # runs: the fused head outside the compiled graph


def test_a_compiled_model_on_several_processes_is_refused_at_the_fused_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled after the construction's check (or by a path it does not see): the fused forward itself refuses."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    ids, targets = _toy_batches()[0]
    with pytest.raises(GradAccConfigError, match=r"OptimizedModule.*several processes.*fused_lm_head=False"):
        fused_causal_lm_sum(torch.compile(_ToyLM(), backend="eager"), {"input_ids": ids}, targets)


def test_a_grad_write_whose_set_up_never_ran_is_not_swallowed() -> None:
    """A ``Written`` made without ``__init__`` (what a tracer's copy of it was) raises at the next fused forward, not
    only an "Exception ignored" line on stderr."""
    head = nn.Linear(16, 300, bias=False)
    hidden = torch.randn(6, 16)
    targets = torch.randint(0, 300, (6,))
    fused_cross_entropy_sum(hidden, head.forward, targets).backward()  # .grad exists: the next one may write into it
    broken = object.__new__(into_grad.Written)
    del broken  # __del__ finds no attribute
    with pytest.raises(GradAccUsageError, match="set-up never ran"):
        fused_cross_entropy_sum(hidden, head.forward, targets)
    fused_cross_entropy_sum(hidden, head.forward, targets).backward()  # reported once; going on is fine


# ------------------------------------------------------------- GradAccTrainer with torch_compile=True (issue 36)
def _llama_config() -> tf.LlamaConfig:
    config = tf.LlamaConfig(vocab_size=LARGE_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0)  # fmt: skip
    config._attn_implementation = "eager"
    return config


def _samples() -> list[dict]:
    """Four equal-length completion-only rows (one compiled shape per micro-batch; the prompts differ in length)."""
    g = torch.Generator().manual_seed(5)
    samples = []
    for i in range(4):
        ids = torch.randint(2, LARGE_VOCAB, (48,), generator=g).tolist()
        samples.append({"input_ids": ids, "labels": [-100] * (16 + 4 * i) + ids[16 + 4 * i :]})
    return samples


def _choice_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "fused_lm_head" in r.getMessage() and r.levelno == logging.INFO]


@pytest.fixture
def info_logs(caplog: pytest.LogCaptureFixture):
    before = tf.logging.get_verbosity()
    tf.logging.set_verbosity_info()
    try:
        with caplog.at_level(logging.INFO, logger="hf_gradacc"):
            yield caplog
    finally:
        tf.logging.set_verbosity(before)


def test_automatic_is_off_at_construction_under_torch_compile_and_for_a_compiled_model(
    info_logs: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    data = {"train_dataset": ListDataset(_samples()), "data_collator": PaddingCollator()}
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=2, args_class=GradAccConfig,
                         torch_compile=True)  # fmt: skip
    trainer = GradAccTrainer(model=tf.LlamaForCausalLM(_llama_config()), args=args, **data)
    assert trainer.step_engine.fused.choice is not None and not trainer.step_engine.fused.choice.enabled
    compiled = torch.compile(tf.LlamaForCausalLM(_llama_config()), backend="eager")
    trainer = GradAccTrainer(model=compiled, args=one_step_args(per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, args_class=GradAccConfig, head_type="causal_lm"),
                             **data)  # fmt: skip (an OptimizedModule's head is not detected: named)
    assert trainer.step_engine.fused.choice is not None and not trainer.step_engine.fused.choice.enabled
    lines = [line for line in _choice_lines(info_logs) if "(automatic): off" in line]
    assert len(lines) == 2, lines
    assert "`torch_compile=True` (backend 'inductor')" in lines[0] and "outside the compiled graph" in lines[0]
    assert "OptimizedModule" in lines[1]


@pytest.mark.slow
@pytest.mark.parametrize("setting", [None, True, False])
def test_torch_compile_trains_exactly_with_every_fused_lm_head_setting(
    setting: bool | None, info_logs: pytest.LogCaptureFixture
) -> None:
    """GA 2, SGD lr=1, vocabulary 8192 (where automatic turns the fused head on without torch.compile), the Trainer's
    ``torch_compile=True`` (backend ``aot_eager``: dynamo and AOTAutograd as inductor runs them, without its C++
    builds): every trainable parameter moves, the update equals the float64 reference, the logged ``grad_norm`` is not
    0. Automatic is off (logged, with why); True runs the fused head; False keeps the full logits."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(_llama_config())
    samples = _samples()
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=2, args_class=GradAccConfig,
                         torch_compile=True, torch_compile_backend="aot_eager", fused_lm_head=setting)  # fmt: skip
    trained = tf.LlamaForCausalLM(_llama_config())
    trained.load_state_dict(model.state_dict())
    trainer = GradAccTrainer(model=trained, args=args, train_dataset=ListDataset(samples), data_collator=PaddingCollator())
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"  # it did run compiled
    final = dict(trainer.model.named_parameters())
    update = {n: p.detach() - final[n].detach() for n, p in model.named_parameters() if p.requires_grad}
    still = [n for n, u in update.items() if not bool(u.abs().max() > 0)]
    assert still == [], still
    assert trainer.state.log_history[0]["grad_norm"] > 0
    assert trainer.step_engine.fused_head_ran is bool(setting)
    if setting is None:
        lines = [line for line in _choice_lines(info_logs) if "(automatic)" in line]
        assert len(lines) == 1 and ": off, `torch_compile=True`" in lines[0], lines
    comparison = compare_with_reference(update, model, samples, "causal_lm")
    assert comparison.relative_error <= TOLERANCE, comparison


@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
def test_a_model_compiled_before_the_trainer_is_recognised_by_its_head(task) -> None:
    """``torch.compile(model)`` handed to the trainer: its head is told through the compile wrapper (``_orig_mod``),
    where it was "Cannot tell the loss family of OptimizedModule" (the run itself is exact: 5.9e-08 of the update
    on the tiny causal LM, GA 4, aot_eager; not repeated here, it compiles for half a minute)."""
    from hf_gradacc.heads import detect_head_type, unwrap_model
    from hf_gradacc.testing.tiny import build_tiny_model

    model = build_tiny_model(task, seed=0)
    compiled = torch.compile(model, backend="aot_eager")
    assert unwrap_model(compiled) is model
    assert detect_head_type(compiled) == task


def test_one_step_update_under_torch_compile_names_every_parameter() -> None:
    """The backends' ``full_parameters`` unwrap torch.compile's module too: under ``torch_compile=True`` the gathered
    names are the model's (they were ``_orig_mod.``-prefixed, so ``one_step_update``, what ``hf-gradacc check`` and the
    tests measure with, returned an empty update), and the one-step update equals the float64 reference."""
    from hf_gradacc.testing.one_step import full_parameters, one_step_update
    from hf_gradacc.testing.tiny import build_tiny_model, make_samples

    model, samples = build_tiny_model("causal_lm"), make_samples("causal_lm", 4, seed=0)
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=2, args_class=GradAccConfig,
                         torch_compile=True, torch_compile_backend="aot_eager")  # fmt: skip
    update, trainer = one_step_update(GradAccTrainer, model, samples, args)
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"  # it did run compiled
    assert set(full_parameters(trainer)) == {n for n, _ in model.named_parameters()}
    assert set(update) == {n for n, p in model.named_parameters() if p.requires_grad}
    comparison = compare_with_reference(update, model, samples, "causal_lm")
    assert comparison.relative_error <= TOLERANCE, comparison
