"""Measure the gradient noise scale while training, on a problem whose noise scale is known.

    python examples/noise_scale.py --output_dir out --use_cpu true
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/noise_scale.py --output_dir out \
        --use_cpu true
    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml \
        examples/noise_scale.py --output_dir out

`GradientNoiseScaleCallback` logs ``gns``, the simple noise scale B_simple = tr(S) / |G|^2 of McCandlish et al.
(2018), in the units of the loss's denominator (samples here, tokens for a language model), from two gradients the
accumulation computes anyway: after the first micro-batch of each step and after the whole step. Read it against the
step's batch (``gns/batch_size``): a step over B items makes about as much progress as ``1 / (1 + gns / B)`` of a
noiseless full-gradient step, so accumulating more micro-batches pays while B is below ``gns`` and stops paying well
above it.

The model is `hf_gradacc.testing.noise_problems.LinearScoreModel`: each sample's gradient is the sample itself (times a
fixed direction), so the data's mean and variance set the truth (``--noise_scale``). The script prints both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import HfArgumentParser

from hf_gradacc import GradAccConfig
from hf_gradacc.callbacks import GradientNoiseScaleCallback
from hf_gradacc.testing.noise_problems import NoiseProblem, ScoreSumTrainer

# The callback needs 2+ micro-batches per step; a small learning rate (the gradient does not depend on the weights).
EXAMPLE_DEFAULTS = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
    max_steps=200,
    learning_rate=0.01,
    optim="sgd",
    logging_steps=20,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
)


@dataclass
class ScriptArguments:
    noise_scale: float = field(
        default=16.0, metadata={"help": "The true noise scale of the synthetic data (samples)."}
    )
    ema_decay: float = field(default=0.95, metadata={"help": "Smoothing of the callback's two estimates."})


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = HfArgumentParser((ScriptArguments, GradAccConfig))
    parser.set_defaults(**EXAMPLE_DEFAULTS)  # every one can be given on the command line
    script_args, args = parser.parse_args_into_dataclasses(args=argv)
    problem = NoiseProblem.with_noise_scale(script_args.noise_scale)
    # Enough fresh samples for every step: the noise scale is a property of the data distribution.
    world = max(args.world_size, 1)
    steps = args.max_steps if args.max_steps > 0 else 200
    samples = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    callback = GradientNoiseScaleCallback(ema_decay=script_args.ema_decay, keep_history=True)
    trainer = ScoreSumTrainer(
        model=problem.model(seed=args.seed),
        args=args,
        train_dataset=problem.dataset(samples, seed=args.seed + 1),
        callbacks=[callback],
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    history = callback.history
    run_grad_sq = sum(s.grad_sq for s in history) / max(len(history), 1)
    run_trace = sum(s.trace for s in history) / max(len(history), 1)
    batch = float(history[-1].big_batch) if history else float("nan")
    summary = {
        "steps": float(trainer.state.global_step),
        "num_processes": float(trainer.accelerator.num_processes),
        "batch_size": batch,
        "true_noise_scale": problem.noise_scale,
        "gns": callback.noise_scale if callback.noise_scale is not None else float("nan"),
        "run_noise_scale": run_trace / run_grad_sq if run_grad_sq > 0 else float("nan"),
        "true_grad_sq": problem.grad_sq,
        "gns/grad_sq": callback.grad_sq,
        "true_trace": problem.trace,
        "gns/trace": callback.trace,
    }
    if trainer.is_world_process_zero():
        print("noise scale summary:", summary)
        print(
            f"gns = {summary['gns']:.1f} samples (true {problem.noise_scale:.1f}) for a step of {batch:.0f} samples: a "
            f"step makes {1 / (1 + summary['gns'] / batch):.0%} of the progress of a noiseless one; accumulation "
            f"{'still pays' if batch < summary['gns'] else 'pays less and less'} at this batch size."
        )
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks
    return summary


if __name__ == "__main__":
    main()
