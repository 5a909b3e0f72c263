"""`TokenStatsCallback` on one process: every logged number against a direct count of the step's collated batches.

The batches are recorded by the collator in the order the training loop takes them (step k: batches k*GA ...
k*GA + GA - 1), and the callback's clock is replaced by one that advances 0.5 s per reading, so each step lasts
exactly 0.5 s and ``tokens/per_second`` is known.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.callbacks import TokenStatsCallback, token_stats
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

BATCH_SIZE, GA = 2, 4
STEP_SECONDS = 0.5


class RecordingCollator(PaddingCollator):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[dict[str, torch.Tensor]] = []

    def __call__(self, samples):
        batch = super().__call__(samples)
        self.batches.append(batch)
        return batch


@pytest.fixture
def fake_clock(monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr(token_stats, "_clock", lambda: STEP_SECONDS * next(ticks))


def _train(task: str, *, num_samples: int, max_steps: int, logging_steps: int = 1, **overrides):
    collator = RecordingCollator()
    callback = TokenStatsCallback(keep_history=True)
    args = GradAccConfig(
        output_dir="unused", per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA,
        max_steps=max_steps, logging_steps=logging_steps, report_to=[], save_strategy="no", disable_tqdm=True,
        use_cpu=True, train_sampling_strategy="sequential", **overrides,
    )  # fmt: skip
    trainer = GradAccTrainer(
        model=build_tiny_model(task), args=args, train_dataset=ListDataset(make_samples(task, num_samples, seed=4)),
        data_collator=collator, callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return trainer, callback, logs, collator.batches


def _direct(batches: list[dict[str, torch.Tensor]], *, causal: bool) -> dict[str, float]:
    """One step's numbers, counted from its collated batches."""
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    computed = sum(b["input_ids"].numel() for b in batches)
    targets = sum(int((b["labels"][:, 1:] if causal else b["labels"]).ne(-100).sum()) for b in batches)
    return {
        "tokens/real": real,
        "tokens/computed": computed,
        "tokens/padding_ratio": 1 - real / computed,
        "tokens/target": targets,
        "effective_batch_size": sum(b["input_ids"].shape[0] for b in batches),
        "micro_batches": len(batches),
        "tokens/per_second": real / STEP_SECONDS,
    }


def test_every_logged_step_matches_a_direct_count(fake_clock) -> None:
    # 28 samples: steps of 8, 8, 8 and a short last one of 4 (2 micro-batches)
    trainer, callback, logs, batches = _train("causal_lm", num_samples=28, max_steps=4)
    assert trainer.state.global_step == 4 and len(logs) == 4
    steps = [batches[0:4], batches[4:8], batches[8:12], batches[12:14]]
    for k, (log, step_batches) in enumerate(zip(logs, steps)):
        expected = _direct(step_batches, causal=True)
        assert {key: log[key] for key in expected} == pytest.approx(expected, rel=1e-12), f"step {k + 1}"
    assert logs[-1]["micro_batches"] == 2 and logs[-1]["effective_batch_size"] == 4
    assert 0.1 < logs[0]["tokens/padding_ratio"] < 0.9  # mixed lengths: real padding to report
    assert [s.seconds for s in callback.history] == [STEP_SECONDS] * 4


def test_steps_that_are_not_logged_are_averaged_into_the_next_log_line(fake_clock) -> None:
    trainer, callback, logs, batches = _train("causal_lm", num_samples=32, max_steps=4, logging_steps=2)
    assert [log["step"] for log in logs] == [2, 4]
    for log, first in zip(logs, (0, 8)):
        one = _direct(batches[first : first + 4], causal=True)
        two = _direct(batches[first + 4 : first + 8], causal=True)
        for key in ("tokens/real", "tokens/computed", "tokens/target", "effective_batch_size"):
            assert log[key] == pytest.approx((one[key] + two[key]) / 2), key
        real, computed = one["tokens/real"] + two["tokens/real"], one["tokens/computed"] + two["tokens/computed"]
        assert log["tokens/padding_ratio"] == pytest.approx(1 - real / computed)
        assert log["tokens/per_second"] == pytest.approx(real / (2 * STEP_SECONDS))
    assert len(callback.history) == 4


def test_sequence_classification_has_no_target_tokens(fake_clock) -> None:
    _, _, logs, batches = _train("sequence_classification", num_samples=8, max_steps=1)
    (log,) = logs
    assert "tokens/target" not in log
    assert log["tokens/real"] == sum(int(b["attention_mask"].sum()) for b in batches[:4])
    assert log["effective_batch_size"] == 8


def test_image_classification_logs_samples_per_second(fake_clock) -> None:
    # sample 3 is labelled -100: 7 counted samples in the step's 8 images
    _, _, logs, _ = _train("image_classification", num_samples=8, max_steps=1)
    (log,) = logs
    assert not any(key.startswith("tokens/") for key in log), log
    assert log["effective_batch_size"] == 7 and log["micro_batches"] == 4
    assert log["samples/per_second"] == pytest.approx(7 / STEP_SECONDS)
