"""The logged `loss` and `grad_norm` of a step are those of the full batch, and clipping uses that exact norm.

Per-device batch 2 x GA 4, mixed lengths and heavy padding, one SGD(lr=1) step.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

from hf_gradacc import GradAccTrainer, make_exact
from hf_gradacc.testing.one_step import one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, full_batch_loss, reference_gradients
from hf_gradacc.testing.tiny import TASKS, ListDataset, PaddingCollator, build_tiny_model, make_samples, two_term_loss

TOLERANCE = 1e-5
BATCH_SIZE, GA = 2, 4


def _reference(task: str, model: torch.nn.Module, samples: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    ref = copy.deepcopy(model).double().eval()
    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in PaddingCollator()(samples).items()}
    with torch.no_grad():
        loss = float(full_batch_loss(ref, batch, task))
    return loss, reference_gradients(model, samples, task, PaddingCollator())


def _norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.cat([g.reshape(-1).double() for g in grads.values()]).norm())


@pytest.mark.parametrize("max_grad_norm", [0.0, 1e9], ids=["no_clipping", "clip_at_1e9"])
@pytest.mark.parametrize("task", TASKS)
def test_logged_loss_and_grad_norm_are_the_full_batch_ones(task: str, max_grad_norm: float) -> None:
    model = build_tiny_model(task)
    samples = make_samples(task, BATCH_SIZE * GA, seed=8)
    args = one_step_args(
        per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA, max_grad_norm=max_grad_norm
    )
    _, trainer = one_step_update(GradAccTrainer, model, samples, args)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 1
    expected_loss, reference = _reference(task, model, samples)
    assert logs[0]["loss"] == pytest.approx(expected_loss, rel=TOLERANCE)
    assert "grad_norm" in logs[0], logs[0]
    assert logs[0]["grad_norm"] == pytest.approx(_norm(reference), rel=TOLERANCE)


def test_clipping_scales_the_exact_gradient_to_max_grad_norm() -> None:
    model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", BATCH_SIZE * GA, seed=8)
    _, reference = _reference("causal_lm", model, samples)
    max_grad_norm = 0.25 * _norm(reference)
    args = one_step_args(
        per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA, max_grad_norm=max_grad_norm
    )
    update, trainer = one_step_update(GradAccTrainer, model, samples, args)
    clipped = compare(update, {n: 0.25 * g for n, g in reference.items()})
    assert clipped.relative_error <= TOLERANCE, clipped
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert logged == pytest.approx([_norm(reference)], rel=TOLERANCE)  # the norm before clipping


class _TwoTerms(GradAccTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        terms, outputs = two_term_loss(model, inputs, reg_weight=0.05)
        return (terms, outputs) if return_outputs else terms


def _term_logs(logging_steps: int) -> list[dict]:
    samples = make_samples("causal_lm", BATCH_SIZE * GA * 4, seed=9)
    args = one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA, max_steps=-1,
                         num_train_epochs=1, logging_steps=logging_steps, learning_rate=0.1)  # fmt: skip
    trainer = _TwoTerms(model=build_tiny_model("causal_lm"), args=args, train_dataset=ListDataset(samples),
                        data_collator=PaddingCollator())  # fmt: skip
    trainer.train()
    return [h for h in trainer.state.log_history if "loss/ce" in h]


def test_per_term_logs_are_averaged_over_the_logging_interval() -> None:
    """Logging every 2 steps: `loss/<name>` is the MEAN of the interval's steps (as `loss` is), not their sum."""
    every_step, every_other = _term_logs(1), _term_logs(2)
    assert len(every_step) == 4 and len(every_other) == 2
    for k, log in enumerate(every_other):
        steps = every_step[2 * k : 2 * k + 2]
        for key in ("loss", "loss/ce", "loss/reg"):
            assert log[key] == pytest.approx(sum(s[key] for s in steps) / 2, rel=1e-4), (key, log, steps)
        assert log["loss"] == pytest.approx(log["loss/ce"] + log["loss/reg"], rel=1e-4)


# ------------------------------------------------------------------ the line that says hf_gradacc is active
ACTIVE = "hf_gradacc: exact gradient accumulation"
BANNER = "***** Running training *****"
RUN_CLM_STYLE = Path(__file__).resolve().parents[1] / "distributed" / "workers" / "run_clm_style.py"


@pytest.fixture
def train_records(caplog: pytest.LogCaptureFixture):
    """Run one short training and return the messages of hf_gradacc's AND transformers' records, in order (transformers'
    library logger propagates for the test); transformers' verbosity and propagation are put back afterwards."""
    library = logging.getLogger("transformers")
    propagates = library.propagate

    def run(task: str = "causal_lm", make: Any = None, **overrides: Any) -> list[str]:
        caplog.clear()
        args = one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA, **overrides)
        samples = make_samples(task, BATCH_SIZE * GA, seed=3)
        kwargs = dict(args=args, train_dataset=ListDataset(samples), data_collator=PaddingCollator())
        trainer = (make or GradAccTrainer)(model=build_tiny_model(task), **kwargs)
        trainer.train()
        return [r.getMessage() for r in caplog.records if r.name.split(".")[0] in ("hf_gradacc", "transformers")]

    hf_logging.enable_propagation()
    try:
        yield run
    finally:
        library.propagate = propagates
        hf_logging.set_verbosity_warning()
        logging.getLogger("hf_gradacc").setLevel(logging.NOTSET)


@pytest.mark.parametrize(("task", "count"), [("causal_lm", "tokens"), ("sequence_classification", "samples")])
def test_log_level_info_shows_the_active_line_once_after_the_banner(train_records, task: str, count: str) -> None:
    messages = train_records(task, log_level="info")
    active = [i for i, m in enumerate(messages) if m.startswith(ACTIVE)]
    banner = [i for i, m in enumerate(messages) if BANNER in m]
    assert len(active) == 1 and len(banner) == 1, messages
    assert banner[0] < active[0] <= banner[0] + 12, messages  # right after the banner's lines
    assert messages[active[0]] == (
        f"{ACTIVE}, single process (NO), {task}, GA {GA} x 1 ranks, count by {count}"
    ), messages[active[0]]


def test_log_level_warning_shows_neither_the_banner_nor_the_line(train_records) -> None:
    messages = train_records(log_level="warning")
    assert not [m for m in messages if m.startswith(ACTIVE) or BANNER in m], messages


@pytest.mark.parametrize("replica_level", ["warning", "info"])
def test_a_replica_follows_log_level_replica(train_records, monkeypatch, replica_level: str) -> None:
    """`should_log` False is what every process but the main one sees: the Trainer sets its verbosity from
    `log_level_replica`, and the line follows (a 2-rank run: tests/distributed/test_active_line.py)."""
    monkeypatch.setattr(TrainingArguments, "should_log", property(lambda self: False))
    messages = train_records(log_level="info", log_level_replica=replica_level)
    shown = [m for m in messages if m.startswith(ACTIVE)]
    assert len(shown) == (replica_level == "info") == len([m for m in messages if BANNER in m]), messages


def test_make_exact_says_so_at_log_level_info(train_records) -> None:
    def stock_made_exact(**kwargs: Any) -> Trainer:
        return make_exact(Trainer(**kwargs))

    messages = train_records(make=stock_made_exact, log_level="info")
    assert [m for m in messages if m == "hf_gradacc: Trainer made exact (GradAccTrainer)."], messages
    assert len([m for m in messages if m.startswith(ACTIVE)]) == 1, messages


@pytest.mark.parametrize(("log_level", "shown"), [("passive", True), ("error", False)])
def test_hf_gradacc_warnings_follow_log_level_as_transformers_warnings_do(train_records, log_level, shown) -> None:
    messages = train_records(log_level=log_level, average_tokens_across_devices=False)
    assert any("`average_tokens_across_devices=False` is ignored" in m for m in messages) is shown, messages


@pytest.mark.slow
@pytest.mark.parametrize("logging_config", ["run_clm", "none"])
def test_a_user_script_with_log_level_info_prints_the_line_once(tmp_path: Path, logging_config: str) -> None:
    """A fresh process, as users run it: run_clm.py's logging set-up (a root handler on stdout; the line goes there), or
    none at all (only transformers' handler on stderr; hf_gradacc prints its records there as transformers does)."""
    flags = ["--output_dir", str(tmp_path), "--max_steps", "1", "--per_device_train_batch_size", "2",
             "--gradient_accumulation_steps", "4", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true",
             "--save_strategy", "no", "--log_level", "info"]  # fmt: skip
    if logging_config == "none":
        flags.append("--no_logging_config")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CI": ""}
    proc = subprocess.run([sys.executable, str(RUN_CLM_STYLE), *flags], capture_output=True, text=True, env=env,
                          cwd=RUN_CLM_STYLE.parents[3], timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    assert output.count(BANNER) == 1 and output.count(ACTIVE) == 1, output
    assert f"{ACTIVE}, single process (NO), causal_lm, GA 4 x 1 ranks, count by tokens" in output, output
