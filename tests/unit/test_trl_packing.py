"""Packed, regrouped and token-budget micro-batches with TRL's trainers (one process; 2 DDP ranks in
tests/distributed/test_trl.py).

SFT: ``pack_micro_batches`` collates every packed micro-batch with TRL's own collator in its padding-free mode (labels
as TRL's dataset preparation built them: completion-only and assistant-only masks), ``regroup_micro_batches`` and
``max_tokens_per_micro_batch`` regroup TRL's tokenized rows. DPO / reward: regrouping keeps every pair whole (one
process), packing is refused.

Every exactness test runs ONE SGD(lr=1) step over a dataset of exactly one step, so the update is minus the accumulated
gradient, and compares it with the padded GradAccSFTTrainer step (same samples, stock grouping) and with the float64
full-batch reference of ``hf_gradacc/testing/trl_steps.py`` (every sample alone, masks written out by hand, no TRL
code). Tolerance: relative error <= 1e-5. Every run sets ``bf16=False`` (TRL's default bf16 rounds at ~2e-3 on CPU).
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from hf_gradacc import GradAccConfigError  # noqa: E402
from hf_gradacc.data import find_regroup_sampler  # noqa: E402
from hf_gradacc.data.pack import WindowPackBatchSampler, packed_sequence_lengths  # noqa: E402
from hf_gradacc.testing import trl_steps  # noqa: E402
from hf_gradacc.testing.one_step import one_step_args  # noqa: E402
from hf_gradacc.testing.reference import compare  # noqa: E402
from hf_gradacc.testing.tiny import build_tiny_model  # noqa: E402
from hf_gradacc.testing.trl_steps import (  # noqa: E402
    CHAT_TEMPLATE,
    build_tiny_reward_model,
    chat_conversations,
    cpu_config_flags,
    dpo_dataset,
    dpo_pairs,
    reward_rows,
    sft_rows,
    sft_text_dataset,
    word_tokenizer,
)
from hf_gradacc.trl import (  # noqa: E402
    GradAccDPOConfig,
    GradAccDPOTrainer,
    GradAccRewardConfig,
    GradAccRewardTrainer,
    GradAccSFTConfig,
    GradAccSFTTrainer,
)

TOL = 1e-5
NUM_SAMPLES, BS, GA = 12, 3, 4  # one optimizer step of 12 prompt-completion rows (2 to 19 tokens), stock 3 x GA 4
BUDGET = 40  # tokens per micro-batch: rows x longest row (regrouped), or the packed row's length
MODES = {
    "pack": dict(pack_micro_batches=True),
    "pack_budget": dict(pack_micro_batches=True, max_tokens_per_micro_batch=BUDGET),
    "regroup": dict(regroup_micro_batches=True),
    "budget": dict(max_tokens_per_micro_batch=BUDGET),
}
COMPLETION_ONLY = dict(completion_only_loss=True, max_length=None)


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    """TRL pings the Hub when a trainer is built; tests run offline."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)


class Recording:
    """Keeps the micro-batches of every optimizer step, as the step trained them."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.__dict__.setdefault("windows", []).append(batches)
        return batches, num_items


class RecordingSFT(Recording, GradAccSFTTrainer):
    pass


class RecordingDPO(Recording, GradAccDPOTrainer):
    pass


class RecordingReward(Recording, GradAccRewardTrainer):
    pass


def one_step(
    trainer_class: type,
    config_class: type,
    model: torch.nn.Module,
    dataset: Any,
    tmp_path,
    *,
    split: tuple[int, int] = (BS, GA),
    tokenizer: Any = None,
    trainer_kwargs: dict[str, Any] | None = None,
    **config: Any,
) -> tuple[dict[str, torch.Tensor], Any]:
    """Train a copy of ``model`` for one SGD(lr=1) step; return ``{name: initial - final}`` and the trainer."""
    args = one_step_args(str(tmp_path), per_device_train_batch_size=split[0], gradient_accumulation_steps=split[1],
                         args_class=config_class, **cpu_config_flags(config_class), **config)  # fmt: skip
    trainer = trainer_class(model=copy.deepcopy(model), args=args, train_dataset=dataset,
                            processing_class=tokenizer or word_tokenizer(), **(trainer_kwargs or {}))  # fmt: skip
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    final = dict(trainer.model.named_parameters())
    return {n: initial[n] - final[n].detach() for n in initial}, trainer


def sequences(batch: dict[str, Any]) -> list[tuple[int, ...]]:
    """The token ids of every sequence of a micro-batch: cut where a padding-free row's sequences start (TRL's packed
    documents; ``cu_seq_lens_q``, or ``position_ids`` restarting at 0 where TRL < 1.15's collator gives no offsets) or
    read through the attention mask (padded rows)."""
    ids = batch["input_ids"]
    if "attention_mask" not in batch:
        offsets = [0, *itertools.accumulate(packed_sequence_lengths(batch))]
        return [tuple(ids[0, a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:]) if b > a]
    return [tuple(row[mask.bool()].tolist()) for row, mask in zip(ids, batch["attention_mask"])]


def computed_per_real_token(trainer: Any, rows: list[dict[str, list[int]]]) -> float:
    """Token positions the step's forward passes computed, over the tokens of its samples."""
    (window,) = trainer.windows
    return sum(batch["input_ids"].numel() for batch in window) / sum(len(r["input_ids"]) for r in rows)


def train_log(trainer: Any) -> dict[str, float]:
    return next(entry for entry in trainer.state.log_history if "loss" in entry)


# ---------------------------------------------------------------------------------------------- SFT, one step
@pytest.fixture(scope="module")
def sft_step(tmp_path_factory) -> dict[str, Any]:
    """The model, TRL's text rows, the rows TRL trains on, their float64 step, and the padded GradAccSFTTrainer step."""
    model = build_tiny_model("causal_lm")
    dataset, rows = sft_text_dataset(sft_rows(NUM_SAMPLES, seed=3))
    padded, trainer = one_step(RecordingSFT, GradAccSFTConfig, model, dataset, tmp_path_factory.mktemp("padded"),
                               **COMPLETION_ONLY)  # fmt: skip
    return {"model": model, "dataset": dataset, "rows": rows, "reference": trl_steps.sft_reference(model, rows),
            "padded": padded, "padded_trainer": trainer}  # fmt: skip


def test_the_padded_step_is_exact_and_pads(sft_step) -> None:
    """The baseline the modes are compared with: exact, and it computes padding (so the 1.0 below can fail)."""
    assert compare(sft_step["padded"], sft_step["reference"].grads).relative_error <= TOL
    trainer = sft_step["padded_trainer"]
    assert [batch["input_ids"].shape[0] for batch in trainer.windows[0]] == [BS] * GA
    ratio = computed_per_real_token(trainer, sft_step["rows"])
    print(f"GradAccSFTTrainer padded (stock grouping): computed / real tokens {ratio:.3f}")
    assert ratio > 1.2


@pytest.mark.parametrize("mode", list(MODES))
def test_sft_completion_only_modes_equal_the_padded_step_and_float64(tmp_path, sft_step, mode: str) -> None:
    update, trainer = one_step(RecordingSFT, GradAccSFTConfig, sft_step["model"], sft_step["dataset"], tmp_path,
                               **COMPLETION_ONLY, **MODES[mode])  # fmt: skip
    to_padded = compare(update, sft_step["padded"]).relative_error
    to_float64 = compare(update, sft_step["reference"].grads).relative_error
    (window,) = trainer.windows
    ratio = computed_per_real_token(trainer, sft_step["rows"])
    print(f"GradAccSFTTrainer {mode}: vs padded {to_padded:.2g}, vs float64 {to_float64:.2g}, micro-batches "
          f"{[tuple(b['input_ids'].shape) for b in window]}, computed / real tokens {ratio:.3f}")  # fmt: skip
    assert to_padded <= TOL and to_float64 <= TOL
    assert all(float(u.abs().max()) > 0 for u in update.values())  # every parameter moved
    # the step kept exactly its samples: each once, whole (TRL tokenized them; the rows written out here agree)
    trained = Counter(seq for batch in window for seq in sequences(batch))
    assert trained == Counter(tuple(r["input_ids"]) for r in sft_step["rows"])
    padded_log, log = train_log(sft_step["padded_trainer"]), train_log(trainer)
    assert log["loss"] == pytest.approx(padded_log["loss"], rel=TOL)  # the step's mean over its completion tokens
    assert log["num_tokens"] == sum(len(r["input_ids"]) for r in sft_step["rows"])
    if MODES[mode].get("pack_micro_batches"):
        assert isinstance(find_regroup_sampler(trainer.get_train_dataloader()), WindowPackBatchSampler)
        assert all(batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch for batch in window)
        assert ratio == 1.0  # no padding
        assert len(window) < GA if mode == "pack" else len(window) <= GA  # fewer, longer micro-batches
    else:
        assert ratio < computed_per_real_token(sft_step["padded_trainer"], sft_step["rows"])
    if "max_tokens_per_micro_batch" in MODES[mode]:
        assert all(batch["input_ids"].numel() <= BUDGET for batch in window)


class _OnePercentOff(RecordingSFT):
    """Divides every micro-batch by 1.01 x the step's token count: a 1 % denominator error."""

    def _trl_loss_scale(self) -> float:
        return 1.01 * super()._trl_loss_scale()


def test_a_one_percent_denominator_error_fails_the_comparison(tmp_path, sft_step) -> None:
    update, _ = one_step(_OnePercentOff, GradAccSFTConfig, sft_step["model"], sft_step["dataset"], tmp_path,
                         **COMPLETION_ONLY, **MODES["pack"])  # fmt: skip
    error = compare(update, sft_step["reference"].grads).relative_error
    print(f"GradAccSFTTrainer pack with the token count off by 1 %: vs float64 {error:.2g}")
    assert error > 100 * TOL and compare(update, sft_step["padded"]).relative_error > 100 * TOL, error


# ---------------------------------------------------------------------------------------------- TRL's own options
TRL_OPTIONS = {
    # TRL packs the dataset (best-fit decreasing): rows of several documents, their lengths in `seq_lengths`.
    "packing_bfd": dict(completion_only_loss=True, packing=True, max_length=24),
    # TRL flattens each micro-batch into one row.
    "padding_free": dict(completion_only_loss=True, padding_free=True, max_length=None),
}
TRL_CASES = [(option, mode) for option in TRL_OPTIONS for mode in ("pack", "regroup", "budget")]


@pytest.mark.parametrize(("option", "mode"), TRL_CASES, ids=[f"{o}-{m}" for o, m in TRL_CASES])
def test_trl_packing_and_padding_free_with_our_modes_are_exact(tmp_path, sft_step, option: str, mode: str) -> None:
    """TRL's ``packing=True`` rows (several documents each) and ``padding_free=True`` micro-batches, regrouped or
    packed again into one row per micro-batch: the same step. (Before, packing TRL's packed rows raised
    GradAccDataError: the packing collator did not know their ``seq_lengths``.)"""
    update, trainer = one_step(RecordingSFT, GradAccSFTConfig, sft_step["model"], sft_step["dataset"], tmp_path,
                               **TRL_OPTIONS[option], **MODES[mode])  # fmt: skip
    to_float64 = compare(update, sft_step["reference"].grads).relative_error
    to_padded = compare(update, sft_step["padded"]).relative_error
    (window,) = trainer.windows
    print(f"GradAccSFTTrainer {option} + {mode}: vs padded {to_padded:.2g}, vs float64 {to_float64:.2g}, "
          f"micro-batches {[tuple(b['input_ids'].shape) for b in window]}")  # fmt: skip
    assert to_float64 <= TOL and to_padded <= TOL
    trained = Counter(seq for batch in window for seq in sequences(batch))  # documents, for TRL's packed rows
    assert trained == Counter(tuple(r["input_ids"]) for r in sft_step["rows"])
    assert computed_per_real_token(trainer, sft_step["rows"]) == 1.0  # padding-free either way


def test_trl_wrapped_packing_packed_again_equals_trls_wrapped_step(tmp_path, sft_step) -> None:
    """``packing_strategy="wrapped"`` cuts samples across rows (its rows attend across documents by design), so the
    float64 per-sample step does not apply: packing its rows must equal the step over the same wrapped rows."""
    wrapped = dict(completion_only_loss=True, packing=True, packing_strategy="wrapped", max_length=16)
    args = (GradAccSFTConfig, sft_step["model"], sft_step["dataset"])
    padded, _ = one_step(RecordingSFT, *args, tmp_path / "padded", split=(2, 4), **wrapped)
    packed, trainer = one_step(RecordingSFT, *args, tmp_path / "packed", split=(2, 4), pack_micro_batches=True,
                               **wrapped)  # fmt: skip
    error = compare(packed, padded).relative_error
    print(f"GradAccSFTTrainer packing_strategy='wrapped' + pack: vs the wrapped padded step {error:.2g}")
    assert error <= TOL
    assert all(batch["input_ids"].shape[0] == 1 for batch in trainer.windows[0])


def test_pad_to_multiple_of_is_honoured_by_packed_rows(tmp_path, sft_step) -> None:
    update, trainer = one_step(RecordingSFT, GradAccSFTConfig, sft_step["model"], sft_step["dataset"], tmp_path,
                               pad_to_multiple_of=8, **COMPLETION_ONLY, **MODES["pack"])  # fmt: skip
    error = compare(update, sft_step["reference"].grads).relative_error
    print(f"GradAccSFTTrainer pack with pad_to_multiple_of=8: vs float64 {error:.2g}")
    assert error <= TOL
    assert all(batch["input_ids"].shape == (1, batch["input_ids"].shape[1]) and batch["input_ids"].shape[1] % 8 == 0
               for batch in trainer.windows[0])  # fmt: skip


@pytest.mark.parametrize("mode", ["pack", "budget"])
def test_assistant_only_loss_on_conversations(tmp_path, mode: str) -> None:
    """TRL turns ``assistant_masks`` into labels when it prepares the dataset; packed and regrouped steps train on
    exactly the assistant turns (the reference writes the mask out turn by turn)."""
    model = build_tiny_model("causal_lm")
    dataset, rows = chat_conversations(8)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    update, trainer = one_step(RecordingSFT, GradAccSFTConfig, model, dataset, tmp_path, split=(2, 4),
                               tokenizer=tokenizer, assistant_only_loss=True, max_length=None,
                               **MODES[mode])  # fmt: skip
    error = compare(update, trl_steps.sft_reference(model, rows).grads).relative_error
    print(f"GradAccSFTTrainer assistant_only_loss + {mode}: vs float64 {error:.2g}")
    assert error <= TOL
    trained = Counter(seq for batch in trainer.windows[0] for seq in sequences(batch))
    assert trained == Counter(tuple(r["input_ids"]) for r in rows)


def test_packing_a_vision_dataset_is_refused_naming_the_field(tmp_path, monkeypatch) -> None:
    """TRL's vision collator builds padded batches from images and text itself: there are no token rows to pack.
    (TRL decides from the dataset's first sample; the text rows here are marked as vision rows after TRL's set-up.)"""
    from trl import SFTTrainer

    original = SFTTrainer.__init__

    def as_vision(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._is_vision_dataset = True

    monkeypatch.setattr(SFTTrainer, "__init__", as_vision)
    args = one_step_args(str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         args_class=GradAccSFTConfig, bf16=False, pack_micro_batches=True, **COMPLETION_ONLY)  # fmt: skip
    with pytest.raises(GradAccConfigError, match="`pack_micro_batches=True` is not supported for a vision dataset"):
        GradAccSFTTrainer(model=build_tiny_model("causal_lm"), args=args, train_dataset=Dataset.from_list(sft_rows(4)),
                          processing_class=word_tokenizer())  # fmt: skip


# ---------------------------------------------------------------------------------------------- DPO, reward
PAIR_BUDGET = 32  # padded tokens: 2 rows per pair x the micro-batch's longest sequence


def _pair_rows(window: list[dict[str, Any]]) -> list[int]:
    return [int(batch["input_ids"].shape[0]) for batch in window]


@pytest.mark.parametrize("mode", ["regroup", "budget"])
def test_dpo_regrouped_step_is_the_mean_over_all_pairs(tmp_path, mode: str) -> None:
    model, pairs = build_tiny_model("causal_lm"), dpo_pairs()
    config = {"regroup": dict(regroup_micro_batches=True), "budget": dict(max_tokens_per_micro_batch=PAIR_BUDGET)}
    update, trainer = one_step(RecordingDPO, GradAccDPOConfig, model, dpo_dataset(pairs), tmp_path, split=(2, 4),
                               trainer_kwargs={"ref_model": copy.deepcopy(model)}, beta=0.1,
                               **config[mode])  # fmt: skip
    error = compare(update, trl_steps.dpo_reference(model, pairs, beta=0.1).grads).relative_error
    (window,) = trainer.windows
    print(
        f"GradAccDPOTrainer {mode}: vs float64 {error:.2g}, micro-batches {[tuple(b['input_ids'].shape) for b in window]}"
    )
    assert error <= TOL
    assert all(rows % 2 == 0 for rows in _pair_rows(window)) and sum(_pair_rows(window)) == 2 * len(pairs)
    if mode == "regroup":
        assert _pair_rows(window) != [4, 4, 4, 2]  # regrouped: not the stock 2 + 2 + 2 + 1 pairs
    else:
        assert all(batch["input_ids"].numel() <= PAIR_BUDGET for batch in window) and len(window) > 4


@pytest.mark.parametrize("mode", ["regroup", "budget"])
def test_reward_regrouped_step_is_the_mean_over_all_pairs(tmp_path, mode: str) -> None:
    model, rows = build_tiny_reward_model(), reward_rows()
    config = {"regroup": dict(regroup_micro_batches=True), "budget": dict(max_tokens_per_micro_batch=PAIR_BUDGET)}
    update, trainer = one_step(RecordingReward, GradAccRewardConfig, model, Dataset.from_list(rows), tmp_path,
                               split=(2, 4), center_rewards_coefficient=0.01, **config[mode])  # fmt: skip
    error = compare(update, trl_steps.reward_reference(model, rows, center=0.01).grads).relative_error
    (window,) = trainer.windows
    print(f"GradAccRewardTrainer {mode}: vs float64 {error:.2g}, micro-batches "
          f"{[tuple(b['input_ids'].shape) for b in window]}")  # fmt: skip
    assert error <= TOL
    assert sum(_pair_rows(window)) == 2 * len(rows)
    if mode == "budget":
        assert all(batch["input_ids"].numel() <= PAIR_BUDGET for batch in window) and len(window) > 4


def test_packing_preference_pairs_is_refused_naming_the_field(tmp_path) -> None:
    model = build_tiny_model("causal_lm")
    args = one_step_args(str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=4,
                         args_class=GradAccDPOConfig, bf16=False, pack_micro_batches=True)  # fmt: skip
    with pytest.raises(GradAccConfigError, match="`pack_micro_batches=True` is not supported by GradAccDPOTrainer"):
        GradAccDPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=dpo_dataset(dpo_pairs()),
                          processing_class=word_tokenizer())  # fmt: skip
    from trl import RewardConfig

    plain = one_step_args(str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=4,
                          args_class=RewardConfig, bf16=False)  # fmt: skip
    with pytest.raises(GradAccConfigError, match="`pack_micro_batches=True` is not supported by GradAccRewardTrainer"):
        GradAccRewardTrainer(model=build_tiny_reward_model(), args=plain, train_dataset=Dataset.from_list(reward_rows()),
                             processing_class=word_tokenizer(), gradacc_args={"pack_micro_batches": True})  # fmt: skip


def test_a_budget_below_a_pairs_footprint_names_the_pair(tmp_path) -> None:
    rows = reward_rows()
    widest = max(range(len(rows)), key=lambda i: max(len(rows[i]["chosen_ids"]), len(rows[i]["rejected_ids"])))
    footprint = 2 * max(len(rows[widest]["chosen_ids"]), len(rows[widest]["rejected_ids"]))
    with pytest.raises(GradAccConfigError, match=rf"Preference pair {widest} needs {footprint} padded tokens"):
        one_step(GradAccRewardTrainer, GradAccRewardConfig, build_tiny_reward_model(), Dataset.from_list(rows),
                 tmp_path, split=(2, 4), max_tokens_per_micro_batch=footprint - 1)  # fmt: skip
