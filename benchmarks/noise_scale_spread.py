"""How far GradientNoiseScaleCallback's estimate lands from the known noise scale, over seeds: the number behind the
tolerance of tests/unit/test_noise_scale.py and the README's "within N %".

    python benchmarks/noise_scale_spread.py --seeds 20

For each configuration of the unit test (truth 16 at batch 4 x GA 4, 6 at 2 x 8, 48 at 8 x 8; 150 steps, one
process) and each seed (the data drawn from ``seed``, the Trainer's ``seed`` too), prints the relative error of the
estimate over the run and of the smoothed ``gns``, then per configuration their mean, standard deviation and
largest absolute value. The estimator is unbiased, so the error is the sampling spread of 150 steps.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile

import torch
import transformers

from hf_gradacc import GradAccConfig
from hf_gradacc.callbacks import GradientNoiseScaleCallback
from hf_gradacc.testing.noise_problems import NoiseProblem, ScoreSumTrainer

CONFIGS = ((16.0, 4, 4), (6.0, 2, 8), (48.0, 8, 8))  # (true noise scale, per-device batch, GA): the unit test's


def errors(noise_scale: float, bs: int, ga: int, seed: int, steps: int) -> tuple[float, float]:
    """(run estimate / truth - 1, smoothed gns / truth - 1) of one run."""
    problem = NoiseProblem.with_noise_scale(noise_scale)
    callback = GradientNoiseScaleCallback(keep_history=True)
    args = GradAccConfig(output_dir=tempfile.mkdtemp(prefix="gns_spread_"), per_device_train_batch_size=bs,
                         gradient_accumulation_steps=ga, max_steps=steps, learning_rate=0.01, optim="sgd",
                         max_grad_norm=0.0, report_to=[], save_strategy="no", logging_steps=10, disable_tqdm=True,
                         use_cpu=True, seed=seed)  # fmt: skip
    trainer = ScoreSumTrainer(model=problem.model(), args=args, train_dataset=problem.dataset(steps * bs * ga, seed=seed),
                              callbacks=[callback])  # fmt: skip
    trainer.train()
    run = sum(s.trace for s in callback.history) / sum(s.grad_sq for s in callback.history)
    return run / problem.noise_scale - 1, callback.noise_scale / problem.noise_scale - 1


def main(argv: list[str] | None = None) -> dict[tuple[float, int, int], dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=150)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("hf_gradacc").setLevel(logging.ERROR)
    summary = {}
    for config in CONFIGS:
        runs, smoothed = [], []
        for seed in range(options.seeds):
            run, ema = errors(*config, seed=seed, steps=options.steps)
            runs.append(run)
            smoothed.append(ema)
            print(f"truth {config[0]:>4} ({config[1]} x {config[2]}) seed {seed:>2}: run {run:+.4f}  gns {ema:+.4f}")
        summary[config] = {
            "run_mean": statistics.fmean(runs), "run_std": statistics.stdev(runs), "run_max": max(map(abs, runs)),
            "gns_mean": statistics.fmean(smoothed), "gns_std": statistics.stdev(smoothed),
            "gns_max": max(map(abs, smoothed)),
        }  # fmt: skip
    for (truth, bs, ga), row in summary.items():
        print(f"truth {truth:>4} ({bs} x {ga}), {options.seeds} seeds: "
              f"run {row['run_mean']:+.2%} +- {row['run_std']:.2%} (largest {row['run_max']:.2%}); "
              f"gns {row['gns_mean']:+.2%} +- {row['gns_std']:.2%} (largest {row['gns_max']:.2%})")  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
