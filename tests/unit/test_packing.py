"""`pack_micro_batches=True` through the trainer: every micro-batch is one padding-free row (or, with a dense
attention kernel, padded where that costs less: AttentionCostModel), the step keeps its samples, and the update equals the padded run and the float64 reference (one process; 2 DDP ranks in
tests/distributed/test_regroup_ddp.py). The planner and the collator alone: tests/unit/test_pack.py."""

from __future__ import annotations

import copy
import logging
from collections import Counter

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccTrainer, LossTerm
from hf_gradacc.counting import count_micro_batch
from hf_gradacc.data import find_regroup_sampler
from hf_gradacc.data.pack import WindowPackBatchSampler
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import ListDataset, ListIterableDataset, PaddingCollator, build_tiny_model, make_samples

TOL = 1e-5


class Recording(GradAccTrainer):
    """Records the micro-batches each optimizer step fetched."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.__dict__.setdefault("windows", []).append(batches)
        return batches, count


def _flat(update: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([update[n].double().reshape(-1) for n in sorted(update)])


def _difference(a, b) -> float:
    return float((_flat(a) - _flat(b)).norm() / _flat(b).norm())


def _sequences(batch) -> list[tuple[int, ...]]:
    if "cu_seq_lens_q" not in batch:  # a micro-batch the cost model of a dense attention kernel laid out padded
        return [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    offsets = batch["cu_seq_lens_q"].tolist()
    return [tuple(batch["input_ids"][0, a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.mark.parametrize("budget", [None, 64])
def test_one_sgd_step_equals_the_padded_run_and_the_reference(budget) -> None:
    samples = make_samples("causal_lm", 16, seed=4)  # bs 4 x GA 4: one window, mixed lengths
    model = build_tiny_model("causal_lm")
    common = dict(per_device_train_batch_size=4, gradient_accumulation_steps=4, args_class=GradAccConfig)
    plain, _ = one_step_update(GradAccTrainer, model, samples, one_step_args(**common))
    args = one_step_args(**common, pack_micro_batches=True, max_tokens_per_micro_batch=budget)
    update, trainer = one_step_update(Recording, model, samples, args)
    assert isinstance(find_regroup_sampler(trainer.get_train_dataloader()), WindowPackBatchSampler)
    (window,) = trainer.windows
    assert all(batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch for batch in window)  # one row each
    packed = Counter(seq for batch in window for seq in _sequences(batch))
    assert packed == Counter(tuple(s["input_ids"]) for s in samples)  # exactly the step's samples, none split
    if budget is not None:
        assert all(batch["input_ids"].shape[1] <= budget for batch in window)
    assert _difference(update, plain) <= TOL
    assert compare_with_reference(update, model, samples, "causal_lm").relative_error <= TOL


def test_adamw_epochs_equal_the_padded_run() -> None:
    samples = make_samples("causal_lm", 20, seed=5)  # windows of 8, 8 and a short last one of 4
    model = build_tiny_model("causal_lm")
    common = dict(output_dir="unused", report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                  use_cpu=True, per_device_train_batch_size=2, gradient_accumulation_steps=4, learning_rate=1e-3,
                  optim="adamw_torch", num_train_epochs=2)  # fmt: skip
    updates, trainers = [], []
    for overrides in ({}, {"pack_micro_batches": True}):
        work = copy.deepcopy(model)
        initial = {n: p.detach().clone() for n, p in work.named_parameters()}
        trainer = Recording(model=work, args=GradAccConfig(**common, **overrides), train_dataset=ListDataset(samples),
                            data_collator=PaddingCollator())  # fmt: skip
        trainer.train()
        updates.append({n: initial[n] - p.detach() for n, p in work.named_parameters()})
        trainers.append(trainer)
    plain, packed = trainers
    assert plain.state.global_step == packed.state.global_step == 6 and packed.state.epoch == pytest.approx(2.0)
    assert [len(w) for w in packed.windows] != [len(w) for w in plain.windows]  # fewer, longer micro-batches
    assert _difference(updates[1], updates[0]) <= TOL


def test_resume_mid_epoch_replays_the_same_packed_steps(tmp_path) -> None:
    samples = make_samples("causal_lm", 20, seed=8, min_length=16)
    model = build_tiny_model("causal_lm")
    kwargs = dict(output_dir=str(tmp_path), report_to=[], logging_steps=1, disable_tqdm=True, use_cpu=True,
                  per_device_train_batch_size=2, gradient_accumulation_steps=4, learning_rate=1e-3,
                  optim="adamw_torch", num_train_epochs=2, pack_micro_batches=True, max_tokens_per_micro_batch=80,
                  save_strategy="steps", save_steps=4)  # fmt: skip
    full_model = copy.deepcopy(model)
    full = Recording(model=full_model, args=GradAccConfig(**kwargs), train_dataset=ListDataset(samples),
                     data_collator=PaddingCollator())  # fmt: skip
    full.train()
    resumed_model = copy.deepcopy(model)
    resumed = Recording(model=resumed_model, args=GradAccConfig(**kwargs), train_dataset=ListDataset(samples),
                        data_collator=PaddingCollator())  # fmt: skip
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert resumed.state.global_step == full.state.global_step == 6
    replayed = [[_sequences(b) for b in w] for w in resumed.windows]
    assert replayed == [[_sequences(b) for b in w] for w in full.windows[4:]]
    for a, b in zip(full_model.parameters(), resumed_model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


class TokenHungryLlama(LlamaForCausalLM):
    """Runs out of memory on a packed row longer than `max_tokens` (an injected out-of-memory error)."""

    max_tokens = 60

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        if self.training and input_ids.shape[1] > self.max_tokens:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 1 GiB ({input_ids.shape[1]} tokens)")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def test_a_pack_that_runs_out_of_memory_is_split_with_the_same_update(caplog) -> None:
    base = build_tiny_model("causal_lm")
    model = TokenHungryLlama(base.config)
    model.load_state_dict(base.state_dict())
    samples = make_samples("causal_lm", 16, seed=4)
    common = dict(per_device_train_batch_size=4, gradient_accumulation_steps=4, args_class=GradAccConfig)
    plain, _ = one_step_update(GradAccTrainer, base, samples, one_step_args(**common))
    args = one_step_args(**common, pack_micro_batches=True, auto_micro_batch=True)
    with caplog.at_level(logging.WARNING):
        update, trainer = one_step_update(GradAccTrainer, model, samples, args)
    assert trainer.step_engine.auto_rows is not None and "auto_micro_batch: out of memory" in caplog.text
    assert _difference(update, plain) <= TOL


class InputTokenTerms(GradAccTrainer):
    """The token loss, plus a penalty per input token (`"input_tokens"`: the attention mask's ones padded, every
    position of a packed row)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits.float()
        total = self.head.sum_loss(logits, labels)
        mask = inputs.get("attention_mask", torch.ones(logits.shape[:2], device=logits.device)).unsqueeze(-1).float()
        penalty = 0.01 * ((logits**2).mean(-1, keepdim=True) * mask).sum()
        terms = {"lm": LossTerm(total, "tokens"), "size": LossTerm(penalty, "input_tokens")}
        return (terms, outputs) if return_outputs else terms


def test_loss_terms_of_a_packed_step_equal_the_padded_ones() -> None:
    samples = make_samples("causal_lm", 12, seed=6)
    model = build_tiny_model("causal_lm")
    common = dict(per_device_train_batch_size=3, gradient_accumulation_steps=4, args_class=GradAccConfig)
    padded, first = one_step_update(InputTokenTerms, model, samples, one_step_args(**common))
    packed, second = one_step_update(InputTokenTerms, model, samples, one_step_args(**common, pack_micro_batches=True))
    assert _difference(packed, padded) <= TOL
    a, b = first.state.log_history[0], second.state.log_history[0]
    assert a["loss/size"] == pytest.approx(b["loss/size"], rel=1e-5) and a["loss/lm"] == pytest.approx(
        b["loss/lm"], rel=1e-5
    )


def test_a_packed_row_counts_its_sequences_as_samples() -> None:
    from hf_gradacc.data.pack import PackedCollator

    batch = PackedCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [4]}])
    counts = count_micro_batch(batch, "causal_lm")
    assert counts.num_samples == 3 and counts.num_tokens == 3  # targets 6, 7 and 9


@pytest.mark.parametrize("task", ["masked_lm", "seq2seq", "sequence_classification"])
def test_models_that_cannot_keep_samples_apart_are_refused(task) -> None:
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=2, args_class=GradAccConfig,
                         pack_micro_batches=True)  # fmt: skip
    with pytest.raises(GradAccConfigError, match="pack"):
        GradAccTrainer(model=build_tiny_model(task), args=args)


def test_an_iterable_dataset_is_not_packed_with_a_warning(caplog) -> None:
    samples = make_samples("causal_lm", 8, seed=7)
    model = build_tiny_model("causal_lm")
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         pack_micro_batches=True)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        update, _ = one_step_update(GradAccTrainer, model, samples, args, train_dataset=ListIterableDataset(samples))
    assert "not applied to an IterableDataset" in caplog.text
    assert compare_with_reference(update, model, samples, "causal_lm").relative_error <= TOL


def test_a_user_collator_replaced_by_packing_is_warned_about(caplog) -> None:
    def my_collator(samples):  # a collator of the user's: packing replaces it, with a warning
        return PaddingCollator()(samples)

    samples = make_samples("causal_lm", 8, seed=9)
    model = build_tiny_model("causal_lm")
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         pack_micro_batches=True)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        update, _ = one_step_update(GradAccTrainer, model, samples, args, data_collator=my_collator)
    assert "not by the given data_collator (function)" in caplog.text
    assert compare_with_reference(update, model, samples, "causal_lm").relative_error <= TOL


def test_the_packed_example_trains_the_padded_steps(tmp_path) -> None:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "packed_clm.py"
    spec = importlib.util.spec_from_file_location("packed_clm_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["packed_clm_example"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    common = ["--output_dir", str(tmp_path), "--num_samples", "40", "--per_device_train_batch_size", "4",
              "--gradient_accumulation_steps", "4", "--num_train_epochs", "2", "--optim", "sgd", "--learning_rate",
              "0.5", "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--report_to", "none",
              "--save_strategy", "no", "--use_cpu", "true", "--disable_tqdm", "true"]  # fmt: skip
    padded = module.main([*common, "--pack_micro_batches", "false"])
    packed = module.main([*common, "--pack_micro_batches", "true"])
    assert packed["global_step"] == padded["global_step"] == 6  # 3 steps per epoch (the last one short), 2 epochs
    # sdpa on CPU is a dense kernel: the micro-batches that cost less padded are padded, tighter than the stock ones
    assert 1.0 <= packed["computed_per_real_token"] < padded["computed_per_real_token"]
    difference = (packed["parameters"] - padded["parameters"]).norm() / padded["parameters"].norm()
    initial = torch.cat([p.detach().reshape(-1) for p in module.build_tiny_model("causal_lm", seed=42).parameters()])
    moved = (padded["parameters"] - initial).norm() / initial.norm()
    assert float(difference) <= 1e-5 and float(moved) > 1e-3  # the runs trained, and trained the same
    assert packed["train_loss"] == pytest.approx(padded["train_loss"], rel=1e-5)
