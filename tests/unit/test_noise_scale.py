"""GradientNoiseScaleCallback on one process: the estimator, the two gradient reads against float64 references, the
estimate against problems whose noise scale is known (`hf_gradacc.testing.noise_problems`), what it refuses, and
examples/noise_scale.py. The 2-rank backends are in tests/distributed/test_noise_scale.py."""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_gradacc import GradAccConfig, GradientsNotReadyError, UnsupportedBackendError
from hf_gradacc.callbacks import GradAccCallback, GradientNoiseScaleCallback, noise_scale_estimates
from hf_gradacc.callbacks.noise_scale import _Ema
from hf_gradacc.counting import MicroBatchCounts, gather_window_counts
from hf_gradacc.testing.noise_problems import NoiseProblem, ScoreSumTrainer, mean_gradient_sq_norm

ROOT = Path(__file__).resolve().parents[2]
EXACT = 1e-5
# The estimate's sampling spread over 150 steps, measured over 12 seeds of each problem below by
# `python benchmarks/noise_scale_spread.py --seeds 12` (one process): the estimate over the run is unbiased with a
# standard deviation of 1.4-3.0 % (largest error 6.4 %), the smoothed `gns` 2.6-7.6 % (largest 15.6 %). A bound of
# about three standard deviations each; a 10 % bias in the run's estimate is outside it.
RUN_TOLERANCE = 0.10
SMOOTHED_TOLERANCE = 0.20


def _args(tmp_path, *, steps: int, bs: int = 4, ga: int = 4, **overrides) -> GradAccConfig:
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=ga,
        max_steps=steps,
        learning_rate=0.01,
        optim="sgd",
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    kwargs.update(overrides)
    return GradAccConfig(**kwargs)


def _train(tmp_path, problem: NoiseProblem, *, steps: int, bs: int = 4, ga: int = 4, callbacks=(), **overrides):
    torch.set_num_threads(1)
    callback = GradientNoiseScaleCallback(keep_history=True)
    trainer = ScoreSumTrainer(
        model=problem.model(),
        args=_args(tmp_path, steps=steps, bs=bs, ga=ga, **overrides),
        train_dataset=problem.dataset(steps * bs * ga, seed=1),
        callbacks=[*callbacks, callback],
    )
    trainer.train()
    return trainer, callback


def _run_estimate(callback: GradientNoiseScaleCallback) -> float:
    history = callback.history
    return sum(s.trace for s in history) / sum(s.grad_sq for s in history)


# ---------------------------------------------------------------------------------------------- the estimator
def test_the_estimates_are_exact_on_expected_norms():
    """E|G_b|^2 = |G|^2 + tr(S)/b for a mean over b items: fed the expectations, the estimates return the truth."""
    grad_sq, trace = 3.0, 48.0
    for b, big in ((1, 2), (4, 16), (8, 32), (7, 1000)):
        got = noise_scale_estimates(grad_sq + trace / b, b, grad_sq + trace / big, big)
        assert got == pytest.approx((grad_sq, trace), rel=1e-12)


@pytest.mark.parametrize(("b", "big"), [(0, 8), (8, 8), (9, 8)])
def test_the_estimates_need_a_smaller_batch_that_is_smaller(b, big):
    with pytest.raises(ValueError, match="small_batch"):
        noise_scale_estimates(1.0, b, 1.0, big)


def test_the_moving_average_is_bias_corrected():
    ema = _Ema(0.9)
    assert math.isnan(ema.value)
    ema.update(5.0)
    assert ema.value == pytest.approx(5.0)  # not 0.5: the first value is the mean so far
    ema.update(7.0)
    assert ema.value == pytest.approx((0.9 * 0.1 * 5.0 + 0.1 * 7.0) / (1 - 0.81))


@pytest.mark.parametrize(
    "kwargs", [{"ema_decay": 1.0}, {"ema_decay": -0.1}, {"ema_decay": True}, {"denominator": "rows"}]
)
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        GradientNoiseScaleCallback(**kwargs)


def test_the_first_micro_batch_is_counted_over_ranks_in_the_same_collective():
    """`WindowCounts.global_first`: micro-batch 0 of every rank, from the step's one all_gather; dropped on resplit."""
    ranks = [
        [MicroBatchCounts(num_tokens=5, num_samples=2), MicroBatchCounts(num_tokens=9, num_samples=3)],
        [MicroBatchCounts(num_tokens=7, num_samples=1)],
    ]
    calls = []

    def fake_all_gather(local: torch.Tensor) -> torch.Tensor:  # rank 0's view: the other row computed alike
        calls.append(local)
        other = gather_window_counts(ranks[1], lambda t: t.unsqueeze(0)).global_first
        row = local.clone()
        row[7:10] = torch.tensor([other.num_tokens, other.num_samples, other.num_input_tokens])
        return torch.stack([local, row])

    counts = gather_window_counts(ranks[0], fake_all_gather)
    assert len(calls) == 1
    assert (counts.global_first.num_tokens, counts.global_first.num_samples) == (5 + 7, 2 + 1)
    assert counts.global_first.get("samples") == 3
    assert counts.with_micro_batches(ranks[0][::-1]).global_first is None


# ---------------------------------------------------------------------------------------------- one process
class ReferenceNorms(GradAccCallback):
    """The float64 mean-gradient squared norms of the step's first micro-batch and of the whole step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.small: list[float] = []
        self.big: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        batches = self.trainer.current_window.micro_batches
        self.small.append(mean_gradient_sq_norm(self.model, batches[0]["x"]))
        self.big.append(mean_gradient_sq_norm(self.model, torch.cat([b["x"] for b in batches])))


def test_the_two_reads_are_the_mean_gradients_of_the_first_micro_batch_and_of_the_step(tmp_path):
    problem = NoiseProblem.with_noise_scale(16.0)
    reference = ReferenceNorms(problem.model())
    trainer, callback = _train(tmp_path, problem, steps=4, callbacks=[reference])
    assert [s.step for s in callback.history] == [1, 2, 3, 4]
    for k, step in enumerate(callback.history):
        assert not step.reduced and (step.small_batch, step.big_batch) == (4, 16)
        assert step.small_sq_norm == pytest.approx(reference.small[k], rel=EXACT)
        assert step.big_sq_norm == pytest.approx(reference.big[k], rel=EXACT)
        # mis-scaled by the micro-batches per step (the loss is divided by the STEP's count), it would be 16x off
        assert abs(step.small_sq_norm / 16 - reference.small[k]) > 0.5 * reference.small[k]


def test_unequal_micro_batches_use_the_first_micro_batch_size(tmp_path):
    """The epoch's last step has micro-batches of 4, 4, 4 and 2 samples: the small batch is the FIRST micro-batch's
    4 (the mean micro-batch, 3.5, would mis-scale its gradient and the estimate), the big one the step's 14."""
    problem = NoiseProblem.with_noise_scale(16.0)
    reference = ReferenceNorms(problem.model())
    callback = GradientNoiseScaleCallback(keep_history=True)
    args = _args(tmp_path, steps=-1, num_train_epochs=1)
    trainer = ScoreSumTrainer(model=problem.model(), args=args, train_dataset=problem.dataset(3 * 16 - 2, seed=1),
                              callbacks=[reference, callback])  # fmt: skip
    trainer.train()
    assert [(s.small_batch, s.big_batch) for s in callback.history] == [(4, 16), (4, 16), (4, 14)]
    last = callback.history[-1]
    assert last.small_sq_norm == pytest.approx(reference.small[-1], rel=EXACT)
    assert last.big_sq_norm == pytest.approx(reference.big[-1], rel=EXACT)
    expected = noise_scale_estimates(reference.small[-1], 4, reference.big[-1], 14)
    assert (last.grad_sq, last.trace) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize(("noise_scale", "bs", "ga"), [(16.0, 4, 4), (6.0, 2, 8), (48.0, 8, 8)])
def test_the_estimate_is_within_its_measured_spread_of_the_known_noise_scale(tmp_path, noise_scale, bs, ga):
    problem = NoiseProblem.with_noise_scale(noise_scale)
    trainer, callback = _train(tmp_path, problem, steps=150, bs=bs, ga=ga)
    truth = problem.noise_scale
    assert truth == pytest.approx(noise_scale)
    assert callback.num_estimates == 150 and callback.disabled_reason is None
    where = f"run {_run_estimate(callback):.3f}, smoothed {callback.noise_scale:.3f}, truth {truth}"
    assert abs(_run_estimate(callback) / truth - 1) <= RUN_TOLERANCE, where
    assert abs(callback.noise_scale / truth - 1) <= SMOOTHED_TOLERANCE, where
    logged = [h for h in trainer.state.log_history if "gns" in h]
    assert len(logged) == 15
    assert logged[-1]["gns"] == pytest.approx(callback.noise_scale, rel=1e-12)
    assert logged[-1]["gns/grad_sq"] == pytest.approx(callback.grad_sq)
    assert logged[-1]["gns/trace"] == pytest.approx(callback.trace)
    assert logged[-1]["gns/batch_size"] == bs * ga


def test_a_streamed_step_gives_the_same_measurements(tmp_path):
    """`defer_normalization` back-propagates sums and divides after the step: the first micro-batch's gradient is
    scaled differently, the measurements are the same."""
    problem = NoiseProblem.with_noise_scale(16.0)
    _, prefetched = _train(tmp_path / "a", problem, steps=20)
    _, streamed = _train(tmp_path / "b", problem, steps=20, defer_normalization=True)
    assert len(streamed.history) == 20
    for a, b in zip(prefetched.history, streamed.history):
        assert (a.small_batch, a.big_batch) == (b.small_batch, b.big_batch)
        assert b.small_sq_norm == pytest.approx(a.small_sq_norm, rel=EXACT)
        assert b.big_sq_norm == pytest.approx(a.big_sq_norm, rel=EXACT)


def test_one_micro_batch_per_step_logs_nothing_and_says_why(tmp_path, caplog):
    problem = NoiseProblem.with_noise_scale(16.0)
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        trainer, callback = _train(tmp_path, problem, steps=3, ga=1)
    assert callback.num_estimates == 0 and callback.noise_scale is None
    assert not any("gns" in h for h in trainer.state.log_history)
    assert "at least 2 micro-batches" in caplog.text


def test_a_backend_that_cannot_read_the_running_gradient_turns_the_callback_off(tmp_path, caplog):
    """Never a wrong number: an unsupported backend logs nothing, with a warning that says why."""

    class Refuse(GradAccCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            def refuse(params):
                raise UnsupportedBackendError("not readable here (test)")

            self.trainer.backend.running_grad_sq_norm = refuse

    problem = NoiseProblem.with_noise_scale(16.0)
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        trainer, callback = _train(tmp_path, problem, steps=3, callbacks=[Refuse()])
    assert callback.disabled_reason == "not readable here (test)"
    assert callback.num_estimates == 0 and callback.history == []
    assert not any("gns" in h for h in trainer.state.log_history)
    assert trainer.state.global_step == 3  # training goes on
    assert "GradientNoiseScaleCallback is off" in caplog.text


def test_the_running_gradient_is_readable_only_between_micro_batches(tmp_path):
    seen: dict[str, object] = {}

    class Probe(GradAccCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            seen.setdefault("substep", self.trainer.grads.running_sq_norm())

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            try:
                self.trainer.grads.running_sq_norm()
            except GradientsNotReadyError as error:
                seen["pre_step"] = error

    _train(tmp_path, NoiseProblem.with_noise_scale(16.0), steps=1, callbacks=[Probe()])
    assert seen["substep"].sq_norm > 0 and seen["substep"].reduced is False
    assert "between two micro-batches" in str(seen["pre_step"])


def test_fsdp2_hsdp_with_deferred_all_reduce_is_refused():
    """Under HSDP `defer_all_reduce` the running gradient is reduced in the shard group only: neither local nor
    global, so no number."""
    from hf_gradacc.backends.fsdp2 import FSDP2Backend

    backend = FSDP2Backend.__new__(FSDP2Backend)  # no accelerator needed for this branch
    backend.fsdp_sync, backend._hsdp = "defer_all_reduce", True
    with pytest.raises(UnsupportedBackendError, match="defer_all_reduce"):
        backend.running_grad_sq_norm([])


def test_deepspeed_zero2_refuses_what_it_cannot_slice():
    """ZeRO-2 `per_micro_batch` reads DeepSpeed's partition buffers: where they are not there (CPU offload, another
    version), a clear error instead of a number."""
    from hf_gradacc.backends.deepspeed import DeepSpeedBackend

    backend = DeepSpeedBackend.__new__(DeepSpeedBackend)
    backend.zero_stage = 2
    offloaded = SimpleNamespace(all_grad_tensors={}, params_in_partition=[], first_offset=[], partition_size=[],
                                cpu_offload=True)  # fmt: skip
    with pytest.raises(UnsupportedBackendError, match="CPU offload"):
        list(backend._zero2_partition_slices(offloaded))
    with pytest.raises(UnsupportedBackendError, match="all_grad_tensors"):
        list(backend._zero2_partition_slices(SimpleNamespace(params_in_partition=[])))


# ---------------------------------------------------------------------------------------------- the example
def test_the_example_prints_an_estimate_within_its_measured_spread_of_the_truth(tmp_path):
    spec = importlib.util.spec_from_file_location("noise_scale_example", ROOT / "examples" / "noise_scale.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    torch.set_num_threads(1)
    summary = module.main(["--output_dir", str(tmp_path), "--use_cpu", "true", "--max_steps", "150"])
    assert summary["steps"] == 150 and summary["batch_size"] == 16
    truth = summary["true_noise_scale"]
    assert truth == 16.0
    assert abs(summary["gns"] / truth - 1) <= SMOOTHED_TOLERANCE, summary
    assert abs(summary["run_noise_scale"] / truth - 1) <= RUN_TOLERANCE, summary
    assert abs(summary["gns/grad_sq"] / summary["true_grad_sq"] - 1) <= SMOOTHED_TOLERANCE, summary
    assert abs(summary["gns/trace"] / summary["true_trace"] - 1) <= SMOOTHED_TOLERANCE, summary
