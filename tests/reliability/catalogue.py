"""The catalogue of bad inputs and faults, one row each: what the user does, and what hf_gradacc does about it.

Every row runs in ``test_catalogue.py`` (one process) and asserts its outcome; ``docs/reliability.md`` shows the
same rows, rendered by :func:`render_table` (``python -m tests.reliability.catalogue`` prints it; a test keeps the page
and this table equal). Faults between ranks live in ``tests/distributed/test_faults.py``.

Outcomes:

- ``error``: the named error class of the project's hierarchy, whose message holds every key word;
- ``warning``: the run goes on, exact, and a warning holds every key word;
- ``exact``: the run goes on and the update equals the float64 reference within 1e-5;
- ``check``: a specific assertion, described in the row.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, Trainer, TrainerCallback

import hf_gradacc
from hf_gradacc import GradAccArguments, GradAccConfig, GradAccTrainer, LossTerm
from hf_gradacc.callbacks import GradNormCallback
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import ListDataset, ListIterableDataset, PaddingCollator, build_tiny_model, make_samples

from . import cp_cases, label_cases

BS, GA = 2, 4
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Case:
    """One row: ``run()`` does what the user did; ``outcome`` says what must happen."""

    id: str
    what: str  # what the user does
    outcome: str  # "error" | "warning" | "exact" | "check"
    run: Callable[[], Any]
    error: str = ""  # the error class name, for outcome "error"
    words: tuple[str, ...] = ()  # key words of the error / warning message
    result: str = ""  # what happens, in words (the documentation's column)
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- building blocks
def _args(**overrides: Any) -> GradAccConfig:
    return one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA, args_class=GradAccConfig,
                         **overrides)  # fmt: skip


def _samples(task: str = "causal_lm", n: int = BS * GA, seed: int = 11) -> list[dict[str, Any]]:
    return make_samples(task, n, seed=seed)


def _step(trainer_class=GradAccTrainer, *, task="causal_lm", model=None, samples=None, collator=None, args=None,
          **kwargs: Any):  # fmt: skip
    model = model if model is not None else build_tiny_model(task)
    samples = samples if samples is not None else _samples(task)
    update, trainer = one_step_update(trainer_class, model, samples, args or _args(), data_collator=collator, **kwargs)
    return update, trainer, model, samples


def _exact(task: str = "causal_lm", **kwargs: Any) -> float:
    update, _, model, samples = _step(task=task, **kwargs)
    error = compare_with_reference(update, model, samples, task).relative_error
    assert error <= TOLERANCE, error
    return error


def _collator(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable:
    def collate(samples):
        batch = PaddingCollator()(samples)
        edit(batch)
        return batch

    return collate


def _returning(value_fn: Callable[[Any], Any]) -> type:
    class Returning(GradAccTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            value = value_fn(outputs)
            return (value, outputs) if return_outputs else value

    return Returning


def _trainer(**kwargs: Any) -> GradAccTrainer:
    return GradAccTrainer(model=build_tiny_model("causal_lm"), args=kwargs.pop("args", _args()), **kwargs)


def _per_token_loss_func() -> None:
    def per_token(outputs, labels, num_items_in_batch=None):
        return F.cross_entropy(outputs.logits[:, :-1].transpose(1, 2).float(), labels[:, 1:], reduction="none")

    one_step_update(GradAccTrainer, build_tiny_model("causal_lm"), _samples(), _args(),
                    trainer_kwargs={"compute_loss_func": per_token})  # fmt: skip


def _make_exact_after_train() -> None:
    _, trainer = one_step_update(Trainer, build_tiny_model("causal_lm"), _samples(), _args())
    try:
        hf_gradacc.make_exact(trainer)
    finally:
        assert type(trainer) is Trainer


class _OwnStepTrainer(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


def _make_exact_training_step() -> None:
    trainer = _OwnStepTrainer(model=build_tiny_model("causal_lm"), args=_args(), train_dataset=ListDataset(_samples()),
                              data_collator=PaddingCollator())  # fmt: skip
    hf_gradacc.make_exact(trainer)


class _NaNOnce(LlamaForCausalLM):
    """Returns NaN logits for the micro-batch whose first token id is ``poisoned`` (a data-dependent NaN)."""

    poisoned = -1

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        if bool((input_ids[:, 0] == self.poisoned).any()):
            out.logits = out.logits * float("nan")
        return out


def _nan_run(policy: str, steps: int = 2) -> tuple[GradAccTrainer, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    base = build_tiny_model("causal_lm")
    model = _NaNOnce(base.config)
    model.load_state_dict(base.state_dict())
    samples = _samples(n=BS * GA * steps, seed=12)
    model.poisoned = samples[1]["input_ids"][0]  # the first window's first micro-batch
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen: list[dict[str, torch.Tensor]] = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            seen.append({n: p.detach().clone() for n, p in model.named_parameters()})

    args = _args(nonfinite_steps=policy, max_steps=-1, num_train_epochs=1)
    trainer = hf_gradacc_sequential()(model=model, args=args, train_dataset=ListDataset(samples),
                                       data_collator=PaddingCollator(), callbacks=[Snapshot()])  # fmt: skip
    trainer.train()
    return trainer, before, seen[0] if seen else {}


def hf_gradacc_sequential() -> type:
    class Sequential(GradAccTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    return Sequential


def _nan_skip() -> dict[str, Any]:
    trainer, before, after_first = _nan_run("skip")
    assert trainer.num_nonfinite_skipped == 1 and trainer.state.global_step == 1  # the second window trained
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert logs and logs[0]["nonfinite_skipped"] == 1 and math.isfinite(logs[0]["loss"])
    changed = any(not torch.equal(before[n], p) for n, p in after_first.items())
    assert changed  # the first step taken is the second window's: parameters moved, finitely
    return {"skipped": trainer.num_nonfinite_skipped}


def _nan_propagate() -> None:
    trainer, _, _ = _nan_run("propagate", steps=1)
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters())  # as the stock Trainer: poisoned


def _inf_gradient() -> None:
    class InfGrad(GradAccTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.is_last_micro_batch:
                next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("inf"))
            return loss

    update, trainer, _, _ = _step(InfGrad)
    assert trainer.num_nonfinite_skipped == 1 and all(float(u.abs().max()) == 0.0 for u in update.values())


def _all_ignored() -> None:
    update, trainer, _, _ = _step(samples=[{**s, "labels": [-100] * len(s["labels"])} for s in _samples()])
    assert trainer.num_skipped_windows == 1 and all(float(u.abs().max()) == 0.0 for u in update.values())


def _eval_without_labels() -> float:
    samples = [{**s, "labels": [-100] * len(s["labels"])} for s in _samples(n=4)]
    trainer = _trainer(eval_dataset=ListDataset(samples), data_collator=PaddingCollator())
    loss = trainer.evaluate()["eval_loss"]
    assert math.isnan(loss), loss
    return loss


def _resume_killed_save() -> str:
    out = tempfile.mkdtemp(prefix="hf_gradacc_resume_")
    samples = _samples(n=BS * GA * 3, seed=13)
    args = _args(output_dir=out, max_steps=-1, num_train_epochs=1, save_strategy="steps", save_steps=1, optim="adamw_torch",
                 learning_rate=1e-3)  # fmt: skip
    GradAccTrainer(model=build_tiny_model("causal_lm"), args=args, train_dataset=ListDataset(samples),
                   data_collator=PaddingCollator()).train()  # fmt: skip
    os.remove(os.path.join(out, "checkpoint-3", "trainer_state.json"))  # the save of step 3 was killed
    resumed = GradAccTrainer(model=build_tiny_model("causal_lm"), args=args, train_dataset=ListDataset(samples),
                             data_collator=PaddingCollator())  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    return out


def _resume_damaged(damage: str, explicit: bool) -> str:
    """A run saving every step, its newest checkpoint damaged (``damage``: a truncated weights file or a missing
    optimizer state), then resumed with ``True`` or with that folder named."""
    out = tempfile.mkdtemp(prefix="hf_gradacc_damaged_")
    samples = _samples(n=BS * GA * 2, seed=15)
    args = _args(output_dir=out, max_steps=-1, num_train_epochs=1, save_strategy="steps", save_steps=1, optim="adamw_torch",
                 learning_rate=1e-3)  # fmt: skip
    GradAccTrainer(model=build_tiny_model("causal_lm"), args=args, train_dataset=ListDataset(samples),
                   data_collator=PaddingCollator()).train()  # fmt: skip
    newest = os.path.join(out, "checkpoint-2")
    if damage == "optimizer":
        os.remove(os.path.join(newest, "optimizer.pt"))
    else:
        path = os.path.join(newest, "model.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    resumed = GradAccTrainer(model=build_tiny_model("causal_lm"), args=args, train_dataset=ListDataset(samples),
                             data_collator=PaddingCollator())  # fmt: skip
    resumed.train(resume_from_checkpoint=newest if explicit else True)
    assert resumed.state.global_step == 2
    return out


def _resume_changed(num_resumed_samples: int = BS * GA * 3, num_steps: int | None = None, **change: Any) -> None:
    """Saved at step 1 of 3 with batch 2 x GA 4, resumed with ``change`` (and the first ``num_resumed_samples``
    samples); ``num_steps``: the optimizer steps the resumed run must end at."""
    out = tempfile.mkdtemp(prefix="hf_gradacc_changed_")
    samples = _samples(n=BS * GA * 3, seed=16)
    kwargs = dict(output_dir=out, max_steps=-1, num_train_epochs=1, save_strategy="steps", save_steps=1)
    GradAccTrainer(model=build_tiny_model("causal_lm"), args=_args(**kwargs), train_dataset=ListDataset(samples),
                   data_collator=PaddingCollator()).train()  # fmt: skip
    args = one_step_args(args_class=GradAccConfig, **{"per_device_train_batch_size": BS,
                                                      "gradient_accumulation_steps": GA, **kwargs, **change})  # fmt: skip
    resumed = GradAccTrainer(model=build_tiny_model("causal_lm"), args=args,
                             train_dataset=ListDataset(samples[:num_resumed_samples]), data_collator=PaddingCollator())
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))  # fmt: skip
    if num_steps is not None:
        assert resumed.state.global_step == num_steps, resumed.state.global_step


def _resume_nothing() -> None:
    args = _args(output_dir=tempfile.mkdtemp(prefix="hf_gradacc_empty_"))
    _trainer(args=args, train_dataset=ListDataset(_samples()), data_collator=PaddingCollator()).train(
        resume_from_checkpoint=True
    )


class _NotAnOOM(LlamaForCausalLM):
    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        raise RuntimeError("the tokenizer ran out of memory budget for this prompt (a user error, not an allocator's)")


def _not_an_oom() -> None:
    base = build_tiny_model("causal_lm")
    model = _NotAnOOM(base.config)
    _step(model=model, args=_args(auto_micro_batch=True))


class _AlwaysOOM(LlamaForCausalLM):
    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (injected)")


def _oom_one_row() -> None:
    base = build_tiny_model("causal_lm")
    try:
        _step(model=_AlwaysOOM(base.config), args=_args(auto_micro_batch=True))
    except hf_gradacc.GradAccDataError as error:
        assert isinstance(error.__cause__, torch.OutOfMemoryError)  # the original is chained
        raise


def _lr_like_stock() -> list[float]:
    from transformers import Trainer

    samples = _samples(n=BS * GA * 3, seed=14)
    rates = []
    for cls in (GradAccTrainer, Trainer):
        args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA, max_steps=-1,
                             num_train_epochs=1, learning_rate=1e-3, lr_scheduler_type="linear")  # fmt: skip
        trainer = cls(model=build_tiny_model("causal_lm"), args=args, train_dataset=ListDataset(samples),
                      data_collator=PaddingCollator())  # fmt: skip
        trainer.train()
        rates.append([h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h])
    assert rates[0] == rates[1] and rates[0][0] == 1e-3, rates
    return rates[0]


class _SumOverGlobal(GradAccTrainer):
    """A compute_loss that already divides by the step's global count (and returns a plain tensor)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits.float()[:, :-1]
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum")
        loss = total / self.current_window.global_count("tokens")
        return (loss, outputs) if return_outputs else loss


def _masked_row() -> None:
    def edit(batch: dict[str, torch.Tensor]) -> None:
        batch["attention_mask"][0] = 0  # row 0 attends to nothing, its labels still count

    _step(collator=_collator(edit))


def _tokens_seen_without_mask() -> int:
    _, trainer, _, samples = _step(args=_args(include_num_input_tokens_seen="non_padding"),
                                   collator=_collator(lambda b: b.pop("attention_mask")))  # fmt: skip
    seen = trainer.state.num_input_tokens_seen
    assert seen > sum(len(s["input_ids"]) for s in samples), seen  # padding counted, as the stock Trainer falls back to
    return seen


class _UnnormalisedSum(GradAccTrainer):
    """A compute_loss that returns the micro-batch's cross-entropy SUM as a plain tensor (a forgotten division)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits.float()[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum")
        return (loss, outputs) if return_outputs else loss


class _NoLogits(torch.nn.Module):
    def __init__(self, bare: bool) -> None:
        super().__init__()
        self.bare = bare
        self.inner = build_tiny_model("causal_lm")
        self.config = self.inner.config

    def forward(self, input_ids=None, attention_mask=None):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits if self.bare else {"scores": logits}


# ---------------------------------------------------------------------------------------------- hf-gradacc check
def _check_command(*argv: str) -> tuple[int, str, str]:
    """``hf-gradacc check`` in-process: its exit status, printed output and printed errors."""
    import contextlib
    import io

    from hf_gradacc.commands.hf_gradacc_cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["check", *argv])
    return status, out.getvalue(), err.getvalue()


def _check_missing_model() -> None:
    folder = os.path.join(tempfile.mkdtemp(prefix="hf_gradacc_catalogue_"), "missing")
    status, _, err = _check_command("--model", folder)
    assert status == 2 and "is a local path that does not exist" in err, (status, err)


def _check_wrong_task() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    folder = os.path.join(tempfile.mkdtemp(prefix="hf_gradacc_catalogue_"), "bert-cls")
    config = BertConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_labels=3)  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(folder)
    status, out, err = _check_command("--model", folder, "--task", "causal_lm")
    assert status == 2, (status, out, err)
    assert "BertForSequenceClassification" in err and "not a causal LM" in err and "--task" in err, err
    assert "router" not in out + err, (out, err)


def _check_trainer_moe() -> None:
    from hf_gradacc.testing.tiny import build_tiny_moe

    folder = os.path.join(tempfile.mkdtemp(prefix="hf_gradacc_catalogue_"), "mixtral")
    build_tiny_moe("mixtral", router_aux_loss_coef=0.5).save_pretrained(folder)
    status, out, err = _check_command("--trainer", "sft", "--model", folder)
    assert status == 0, (status, out, err)
    assert "router term on (coefficient 0.5)" in out, out


# ---------------------------------------------------------------------------------------------- the table
def _ga(value: Any) -> Callable[[], Any]:
    return lambda: GradAccConfig(output_dir="unused", use_cpu=True, report_to=[], gradient_accumulation_steps=value)


def _knob(**knob: Any) -> Callable[[], Any]:
    return lambda: GradAccArguments(**knob)




CASES: list[Case] = [
    # ---- settings
    Case("ga_zero", "`gradient_accumulation_steps=0`", "error", _ga(0), "GradAccConfigError",
         ("`gradient_accumulation_steps` (0)", ">= 1")),
    Case("head_type_unknown", "`head_type='decoder'`", "error", _knob(head_type="decoder"), "GradAccConfigError",
         ("`head_type` ('decoder')", "causal_lm")),
    Case("ignore_index_str", "`ignore_index='-100'` (a string)", "error", _knob(ignore_index="-100"),
         "GradAccConfigError", ("`ignore_index` ('-100')", "int")),
    Case("zero_reduction_unknown", "`zero_reduction='sometimes'`", "error", _knob(zero_reduction="sometimes"),
         "GradAccConfigError", ("`zero_reduction` ('sometimes')", "per_window")),
    Case("fsdp_sync_unknown", "`fsdp_sync='always'`", "error", _knob(fsdp_sync="always"), "GradAccConfigError",
         ("`fsdp_sync` ('always')", "deferred")),
    Case("nonfinite_unknown", "`nonfinite_steps='ignore'`", "error", _knob(nonfinite_steps="ignore"),
         "GradAccConfigError", ("`nonfinite_steps` ('ignore')", "skip")),
    Case("budget_zero", "`max_tokens_per_micro_batch=0`", "error", _knob(max_tokens_per_micro_batch=0),
         "GradAccConfigError", ("`max_tokens_per_micro_batch` (0)",)),
    Case("regroup_not_bool", "`regroup_micro_batches=1` (not a bool)", "error", _knob(regroup_micro_batches=1),
         "GradAccConfigError", ("`regroup_micro_batches` (1)", "bool")),
    Case("defer_and_per_term", "`defer_normalization` with `backward_per_term`", "error",
         _knob(defer_normalization=True, backward_per_term=True), "GradAccConfigError",
         ("defer_normalization", "backward_per_term")),
    Case("gradacc_args_unknown", "`gradacc_args={'head_typ': ...}` (a typo)", "error",
         lambda: _trainer(args=one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA),
                          gradacc_args={"head_typ": "causal_lm"}),
         "GradAccConfigError", ("unknown field", "head_typ", "did you mean `head_type`?")),
    Case("knobs_twice", "a GradAccConfig AND `gradacc_args`", "error",
         lambda: _trainer(gradacc_args={"head_type": "causal_lm"}), "GradAccConfigError", ("given twice",)),
    Case("tokens_seen_unknown", "`include_num_input_tokens_seen='yes'`", "error",
         lambda: _args(include_num_input_tokens_seen="yes"), "GradAccConfigError",
         ("`include_num_input_tokens_seen` ('yes')", "non_padding")),
    Case("batch_rebalance_regroup", "`train_sampling_strategy='batch_rebalance'` with regrouping", "error",
         lambda: _args(train_sampling_strategy="batch_rebalance", regroup_micro_batches=True), "GradAccConfigError",
         ("batch_rebalance", "regroup_micro_batches")),
    Case("lr_scaling_without_schedule", "`lr_scaling='linear'` without an `accumulation_schedule`", "warning",
         lambda: _exact(args=_args(lr_scaling="linear")), words=("`lr_scaling` ('linear') is ignored",
                                                                 "accumulation_schedule")),
    Case("zero_reduction_unused", "`zero_reduction='per_window'` on a single process", "warning",
         lambda: _exact(args=_args(zero_reduction="per_window")), words=("`zero_reduction='per_window'` is ignored",)),
    Case("fsdp_sync_unused", "`fsdp_sync='every_micro_batch'` without FSDP2", "warning",
         lambda: _exact(args=_args(fsdp_sync="every_micro_batch")), words=("`fsdp_sync='every_micro_batch'` is ignored",)),
    Case("average_tokens_off", "`average_tokens_across_devices=False`", "warning",
         lambda: _exact(args=_args(average_tokens_across_devices=False)), words=("average_tokens_across_devices=False",
                                                                                "ignored")),
    Case("auto_find_batch_size", "`auto_find_batch_size=True`", "warning",
         lambda: _exact(args=_args(auto_find_batch_size=True)), words=("auto_find_batch_size", "effective batch")),
    Case("budget_below_sample", "`max_tokens_per_micro_batch` below the longest sample", "error",
         lambda: _step(args=_args(max_tokens_per_micro_batch=4)), "GradAccConfigError",
         ("`max_tokens_per_micro_batch` (4)", "training sample")),
    Case("unknown_head", "a model whose head family cannot be told", "error",
         lambda: GradAccTrainer(model=_NoLogits(bare=False).inner.model, args=_args()), "GradAccConfigError",
         ("head_type",)),
    # ---- data
    Case("no_labels", "a collator that returns no `labels`", "error",
         lambda: _step(collator=_collator(lambda b: b.pop("labels"))), "GradAccDataError", ("`labels`", "input_ids")),
    Case("float_labels", "float `labels` on a causal LM", "error",
         lambda: _step(collator=_collator(lambda b: b.update(labels=b["labels"].float()))), "GradAccDataError",
         ("torch.float32", "head_type")),
    Case("labels_1d", "1-D `labels` on a causal LM", "error",
         lambda: _step(collator=_collator(lambda b: b.update(labels=b["labels"][:, 0]))), "GradAccDataError",
         ("(batch, sequence)", "causal_lm")),
    Case("labels_short", "`labels` one column shorter than `input_ids`", "error",
         lambda: _step(collator=_collator(lambda b: b.update(labels=b["labels"][:, :-1]))), "GradAccDataError",
         ("one label per input token",)),
    Case("label_id_too_big", "a label id >= the vocabulary", "error",
         lambda: _step(collator=_collator(lambda b: b["labels"].__setitem__((0, -1), 10_000))), "GradAccDataError",
         ("10000", "outside [0, 96)", "ignore_index")),
    Case("label_id_negative", "a label id of -5 (not `ignore_index`)", "error",
         lambda: _step(collator=_collator(lambda b: b["labels"].__setitem__((0, -1), -5))), "GradAccDataError",
         ("-5", "ignore_index")),
    Case("token_labels_sequence_head", "`head_type='sequence_classification'` on a causal LM", "error",
         lambda: _step(args=_args(head_type="sequence_classification")), "GradAccDataError",
         ("integer labels per token", "sequence_classification")),
    Case("class_id_too_big", "a sequence-classification label >= `num_labels`", "error",
         lambda: _step(task="sequence_classification",
                       collator=_collator(lambda b: b["labels"].__setitem__(0, 7))), "GradAccDataError",
         ("7", "num_labels")),
    Case("int32_labels", "int32 `labels`", "exact",
         lambda: _exact(collator=_collator(lambda b: b.update(labels=b["labels"].int()))),
         result="trained as int64 class ids"),
    Case("int8_labels", "int8 `labels` (holding -100 and every id of the vocabulary)", "exact",
         lambda: _exact(collator=_collator(lambda b: b.update(labels=b["labels"].to(torch.int8)))),
         result="trained as int64 class ids"),
    Case("uint8_labels", "uint8 `labels` (-100 wraps to 156)", "error",
         lambda: _step(collator=_collator(lambda b: b.update(labels=b["labels"].to(torch.uint8)))), "GradAccDataError",
         ("torch.uint8", "cannot hold `ignore_index` (-100)", "torch.int64"),
         result="before any compare with `ignore_index`"),
    Case("all_masked_row", "a row whose `attention_mask` is all zeros, with counted labels", "warning", _masked_row,
         words=("`attention_mask` of all zeros", "counted `labels`", "ignore_index"),
         result="trained and counted as the stock Trainer does"),
    Case("tokens_seen_no_mask", "`include_num_input_tokens_seen='non_padding'` without an attention mask or pad id",
         "warning", _tokens_seen_without_mask, words=("no `attention_mask` and no pad id", "padding is counted"),
         result="every position counted, as the stock Trainer falls back to"),
    Case("empty_dataset", "an empty map-style `train_dataset`", "error",
         lambda: _trainer(train_dataset=ListDataset([]), data_collator=PaddingCollator()).train(),
         "GradAccDataError", ("`train_dataset` is empty",)),
    Case("empty_iterable", "an empty IterableDataset", "error",
         lambda: _trainer(args=_args(max_steps=2), train_dataset=ListIterableDataset([]),
                          data_collator=PaddingCollator()).train(),
         "GradAccDataError", ("yielded no batch", "IterableDataset")),
    Case("all_ignored_window", "a step whose every label is ignored", "warning", lambda: _all_ignored(),
         words=("has no counted tokens on any rank", "skipped"), result="skipped on every rank, parameters unchanged"),
    # ---- what compute_loss returns
    Case("loss_not_scalar", "`compute_loss` returns a (batch, seq) tensor", "error",
         lambda: _step(_returning(lambda o: o.logits.float().logsumexp(-1))), "GradAccLossError", ("shape (2,",)),
    Case("loss_float", "`compute_loss` returns a Python float", "error",
         lambda: _step(_returning(lambda o: float(o.loss.detach()))), "GradAccLossError", ("returned a float",)),
    Case("loss_dict_tensor", "`compute_loss` returns `{'lm': tensor}`", "error",
         lambda: _step(_returning(lambda o: {"lm": o.loss})), "GradAccLossError", ("'lm' is a Tensor", "LossTerm")),
    Case("loss_empty_dict", "`compute_loss` returns `{}`", "error",
         lambda: _step(_returning(lambda o: {})), "GradAccLossError", ("empty dict",)),
    Case("count_negative", "`LossTerm(normalize_by=-3)`", "error",
         lambda: LossTerm(torch.tensor(1.0), -3), "GradAccLossError", ("(-3)", "non-negative whole number")),
    Case("count_fraction", "`LossTerm(normalize_by=torch.tensor(2.5))`", "error",
         lambda: LossTerm(torch.tensor(1.0), torch.tensor(2.5)), "GradAccLossError", ("(2.5)", "whole number")),
    Case("count_nan", "`LossTerm(normalize_by=torch.tensor(nan))`", "error",
         lambda: LossTerm(torch.tensor(1.0), torch.tensor(float("nan"))), "GradAccLossError", ("(nan)", "finite")),
    Case("total_not_tensor", "`LossTerm(total=1.0)`", "error", lambda: LossTerm(1.0), "GradAccTypeError",
         ("must be a tensor", "float")),
    Case("denominator_unknown", "`LossTerm(normalize_by='rows')`", "error",
         lambda: LossTerm(torch.tensor(1.0), "rows"), "GradAccLossError", ("('rows')", "tokens")),
    Case("custom_count_prefetched", "a LossTerm with its own count, without `defer_normalization`", "error",
         lambda: _step(_returning(lambda o: LossTerm(o.logits.float().sum(), 3))), "GradAccLossError",
         ("custom count", "defer_normalization=True")),
    Case("output_without_logits", "a model output without `logits`", "error",
         lambda: GradAccTrainer(model=_NoLogits(bare=False), args=_args(head_type="causal_lm"),
                                train_dataset=ListDataset(_samples()), data_collator=PaddingCollator()).train(),
         "GradAccLossError", ("no `logits`", "scores")),
    Case("bare_tensor_output", "a model that returns a bare tensor", "error",
         lambda: GradAccTrainer(model=_NoLogits(bare=True), args=_args(head_type="causal_lm"),
                                train_dataset=ListDataset(_samples()), data_collator=PaddingCollator()).train(),
         "GradAccLossError", ("bare tensor", "ModelOutput")),
    Case("loss_over_global_count", "a plain loss already divided by the step's global count", "error",
         lambda: _step(_SumOverGlobal), "GradAccLossError", ("divided by the step's global count", "LossTerm")),
    Case("loss_unnormalised_sum", "a plain `compute_loss` returning the micro-batch's SUM (no division)", "error",
         lambda: _step(_UnnormalisedSum), "GradAccLossError", ("unnormalised SUM", "num_items_in_batch", "LossTerm"),
         result="refused by the start-up check instead of a gradient ~count x too large"),
    # ---- non-finite steps
    Case("nan_micro_batch_skip", "a micro-batch whose loss is NaN (`nonfinite_steps='skip'`, default)", "warning",
         _nan_skip, words=("micro-batch(es) [1] had a NaN/Inf loss", "skipped on every rank"),
         result="the step is dropped on every rank; `nonfinite_skipped` logged; the next step trains"),
    Case("nan_micro_batch_raise", "a NaN micro-batch with `nonfinite_steps='raise'`", "error",
         lambda: _nan_run("raise"), "NonFiniteStepError", ("Optimizer step 1", "NaN/Inf loss", "nonfinite_steps")),
    Case("nan_micro_batch_propagate", "a NaN micro-batch with `nonfinite_steps='propagate'`", "check", _nan_propagate,
         result="the step is taken, as the stock Trainer does: the parameters turn NaN"),
    Case("inf_gradient", "an infinite gradient with finite losses", "warning", _inf_gradient,
         words=("accumulated gradient is not finite",), result="dropped on every rank, parameters unchanged"),
    # ---- evaluation, resuming, memory, logs, misuse
    Case("eval_nothing_counted", "`evaluate()` on data whose every label is ignored", "warning", _eval_without_labels,
         words=("no counted tokens", "NaN"), result="`eval_loss` is NaN (as the stock Trainer), never 0.0"),
    Case("resume_killed_save", "`resume_from_checkpoint=True` after a save that was killed", "warning",
         _resume_killed_save, words=("Resuming from", "checkpoint-2", "not saved completely"),
         result="resumes from the newest complete checkpoint"),
    Case("resume_truncated_weights", "`resume_from_checkpoint=True` when the newest `model.safetensors` is truncated",
         "warning", lambda: _resume_damaged("weights", explicit=False),
         words=("checkpoint-2", "model.safetensors has", "cannot be resumed"),
         result="resumes from the older complete checkpoint, naming the broken file"),
    Case("resume_no_optimizer", "`resume_from_checkpoint='…/checkpoint-2'` without its `optimizer.pt`", "error",
         lambda: _resume_damaged("optimizer", explicit=True), "GradAccConfigError",
         ("optimizer.pt is missing", "fresh optimizer moments", "resume_from_checkpoint=True"),
         result="never a silent fresh start"),
    Case("resume_changed_ga", "resuming mid-epoch with another `gradient_accumulation_steps` (4 -> 2)", "warning",
         lambda: _resume_changed(gradient_accumulation_steps=2, num_steps=5),
         words=("gradient_accumulation_steps 4 -> 2", "first 8 samples of epoch 0", "continues from sample 8"),
         result="resumes at the checkpoint's sample of the epoch's order, every remaining sample once (the stock "
                "Trainer skips global_step x the NEW samples per step, silently)"),
    Case("resume_changed_batch", "resuming mid-epoch with another per-device batch (2 -> 4)", "warning",
         lambda: _resume_changed(per_device_train_batch_size=4, num_steps=2),
         words=("per_device_train_batch_size 2 -> 4", "continues from sample 8"),
         result="the rest of the epoch re-batched by 4"),
    Case("resume_changed_schedule", "resuming mid-epoch with an `accumulation_schedule` added", "warning",
         lambda: _resume_changed(accumulation_schedule="0:4,2:8", num_steps=3),
         words=("accumulation_schedule None -> '0:4,2:8'", "continues from sample 8"),
         result="the rest of the epoch in the schedule's windows"),
    Case("resume_changed_seed", "resuming mid-epoch with another `seed` (the epoch's order changes)", "error",
         lambda: _resume_changed(seed=1), "GradAccConfigError",
         ("seed=42 (this run: 1)", "samples would be lost or trained twice", "resume_data_mismatch='accept'")),
    Case("resume_changed_dataset", "resuming mid-epoch on a dataset of another length", "error",
         lambda: _resume_changed(num_resumed_samples=20), "GradAccConfigError",
         ("num_train_samples=24 (this run: 20)", "resume_data_mismatch='accept'")),
    Case("resume_mismatch_accepted", "the same, with `resume_data_mismatch='accept'`", "warning",
         lambda: _resume_changed(seed=1, resume_data_mismatch="accept", num_steps=3),
         words=("seed=42 (this run: 1)", "samples may be lost or trained twice"),
         result="the stock resume (skips global_step x the samples per step)"),
    Case("resume_no_checkpoint", "`resume_from_checkpoint=True` with no checkpoint", "error", _resume_nothing,
         "GradAccConfigError", ("no complete checkpoint",)),
    Case("not_an_oom", "`auto_micro_batch` and a RuntimeError that mentions 'out of memory'", "error", _not_an_oom,
         "RuntimeError", ("out of memory budget",), result="re-raised unchanged, not retried"),
    Case("oom_one_row", "`auto_micro_batch` and an out-of-memory on ONE row", "error", _oom_one_row,
         "GradAccDataError", ("ONE sample", "gradient checkpointing"), result="clear error, the OOM chained"),
    Case("lr_logged", "the logged `learning_rate` with a linear schedule", "check", _lr_like_stock,
         result="the rate each step used, as the stock Trainer logs it"),
    Case("backward_outside", "`trainer.backward(...)` outside a training step", "error",
         lambda: _trainer().backward(torch.tensor(1.0, requires_grad=True), final=True), "GradAccUsageError",
         ("inside a training step",)),
    Case("hook_not_callable", "`register_accumulated_grad_hook(42)`", "error",
         lambda: _trainer().register_accumulated_grad_hook(42), "GradAccConfigError", ("callable", "int")),
    Case("grads_outside", "`trainer.grads.norm()` outside the step", "error", lambda: _trainer().grads.norm(),
         "GradientsNotReadyError", ("on_pre_optimizer_step",)),
    Case("grad_norm_depth", "`GradNormCallback(depth=0)`", "error", lambda: GradNormCallback(depth=0),
         "GradAccConfigError", ("`depth` (0)",)),
    Case("loss_func_per_token", "`compute_loss_func` returning per-token losses (not a scalar)", "error",
         _per_token_loss_func, "GradAccLossError", ("`compute_loss_func`", "num_items_in_batch", "LossTerm")),
    Case("make_exact_not_a_trainer", "`make_exact(model)` (not a Trainer)", "error",
         lambda: hf_gradacc.make_exact(build_tiny_model("causal_lm")), "GradAccTypeError", ("transformers.Trainer",)),
    Case("make_exact_after_train", "`make_exact(trainer)` after `trainer.train()`", "error", _make_exact_after_train,
         "GradAccUsageError", ("has started", "before `train()`"), result="the trainer is left as it was"),
    Case("make_exact_training_step", "`make_exact` on a class that overrides `training_step`", "error",
         _make_exact_training_step, "GradAccTypeError", ("overrides ['training_step']", "GradAccMixin")),
    Case("check_missing_model", "`hf-gradacc check --model ./missing` (a local path that does not exist)", "check",
         _check_missing_model, result="exit 2 at once: “is a local path that does not exist” (no Hub retries)"),
    Case("check_wrong_task", "`hf-gradacc check --model <BertForSequenceClassification> --task causal_lm`", "check",
         _check_wrong_task, result="exit 2: the checkpoint's architecture “is not a causal LM”, naming `--task`; "
         "no new LM head loaded silently, no router explanation"),
    Case("check_trainer_moe", "`hf-gradacc check --trainer sft --model <a mixture-of-experts checkpoint>`", "check",
         _check_trainer_moe, result="exact, exit 0: the float64 reference holds the router term (“router term on "
         "(coefficient 0.5)”), as a real SFT run logs `loss/aux`"),
    # ---- label values (label_cases.py)
    Case("bool_class_labels", "torch.bool `labels` on a single-label sequence classifier", "error",
         label_cases.bool_class_labels, "GradAccDataError", ("torch.bool", "`labels.long()`"),
         result="before any step (the stock Trainer's loss raises torch's “expected target dtype to be Long”; a "
         "multi-label head is told `labels.float()`; a regression head trains on 0.0 / 1.0, as stock)"),
    Case("int_regression_targets", "integer `labels` (ratings 0-5) on a regression head (`num_labels=1`)", "exact",
         label_cases.integer_regression_targets, result="trained as numbers, as the stock Trainer's MSELoss does"),
    Case("fused_ignore_minus_one", "`ignore_index=-1` with `fused_lm_head=True`", "exact",
         label_cases.fused_head_ignore_minus_one, result="the start-up check hands the model -100 where -1 is"),
    # ---- context parallelism (cp_cases.py)
    Case("cp_without_fsdp2", "`parallelism_config_cp_size: 2` with a DDP (or DeepSpeed) config", "error",
         cp_cases.cp_under_ddp, "UnsupportedBackendError", ("`parallelism_config.cp_size` (2)", "FSDP2 only")),
    Case("cp_sequence_classifier", "a sequence classifier with `cp_size` 2", "error", cp_cases.cp_sequence_classifier,
         "GradAccConfigError", ("`parallelism_config.cp_size` (2)", "sequence_classification"),
         result="at construction (the stock Trainer fails inside its context-parallel entry on the per-row labels)"),
    Case("cp_left_padding", "a left-padded micro-batch with `cp_size` 2", "error", cp_cases.cp_left_padding,
         "GradAccDataError", ("padding before a real token", "padding_side"),
         result="when it is counted, before its step (torch's context parallelism drops the mask: real tokens "
         "would attend to the padding)"),
    Case("cp_evaluation_with_logits", "`compute_metrics` (or `predict`) with `cp_size` 2", "error",
         cp_cases.cp_evaluation_with_logits, "GradAccConfigError", ("`compute_metrics`", "`eval_loss` alone is exact"),
         result="at the first evaluation batch (each rank holds a shard's logits; `eval_loss` alone is the unsharded "
         "run's)"),
]


def run_case(case: Case) -> Any:
    """Run one row (the test asserts its outcome)."""
    return case.run()


def render_table() -> str:
    """The catalogue as the Markdown table of docs/reliability.md."""
    lines = ["| # | what the user does | what hf_gradacc does |", "| --- | --- | --- |"]
    for k, case in enumerate(CASES, 1):
        if case.outcome == "error":
            outcome = f"`{case.error}`: " + ", ".join(f"“{w}”" for w in case.words)
            if case.result:
                outcome += f"; {case.result}"
        elif case.outcome == "warning":
            outcome = "warns (" + ", ".join(f"“{w}”" for w in case.words) + ")"
            outcome += f"; {case.result}" if case.result else "; the update stays exact"
        elif case.outcome == "exact":
            outcome = "exact" + (f": {case.result}" if case.result else "")
        else:
            outcome = case.result
        lines.append(f"| {k} | {case.what} | {outcome} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_table())
