"""Image classification with BatchNorm under gradient accumulation: a tiny ResNet, precise BatchNorm statistics.

    python examples/image_classification_bn.py --output_dir out --batchnorm precise --gradient_accumulation_steps 4
    python examples/image_classification_bn.py --output_dir out --batchnorm freeze_stats      # every step exact
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/image_classification_bn.py \
        --output_dir out --batchnorm precise --use_cpu true

A BatchNorm layer in training normalises each forward pass by ITS batch's statistics: under accumulation, by the
micro-batch's. GradAccTrainer warns once (with the measured size of the effect) and offers `--batchnorm`:

- `per_micro_batch` (default): the stock behaviour;
- `freeze_stats`: BatchNorm layers normalise by their running statistics and never update them: every optimizer
  step equals the full-batch step (start from a pretrained model whose statistics are meaningful);
- `precise`: train as stock, then recompute the running statistics over `--precise_bn_batches` training
  micro-batches before each evaluation, each save and at the end, so that evaluation uses statistics of the
  current weights rather than an exponential average over earlier ones.

Every GradAccConfig / TrainingArguments field is a flag (HfArgumentParser). The data are synthetic images.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transformers import HfArgumentParser, set_seed

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.callbacks import BatchNormCallback, TokenStatsCallback
from hf_gradacc.testing.tiny import ImageCollator, ListDataset, build_tiny_image_model, make_image_samples


@dataclass
class ScriptArguments:
    num_samples: int = field(default=256, metadata={"help": "Synthetic training images."})
    num_eval_samples: int = field(default=64, metadata={"help": "Synthetic evaluation images."})


def accuracy(prediction: Any) -> dict[str, float]:
    """Top-1 accuracy over the evaluation images whose label is not -100."""
    logits, labels = prediction.predictions, prediction.label_ids
    counted = labels != -100
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels)[counted].mean())}


def train(argv: list[str] | None = None) -> tuple[dict[str, float], GradAccTrainer]:
    """Train and evaluate; returns the summary and the trainer."""
    parser = HfArgumentParser((ScriptArguments, GradAccConfig))
    script_args, args = parser.parse_args_into_dataclasses(args=argv)
    set_seed(args.seed)  # the model is built before the Trainer seeds: same initial weights on every run
    trainer = GradAccTrainer(
        model=build_tiny_image_model("resnet", seed=args.seed),
        args=args,
        train_dataset=ListDataset(make_image_samples(script_args.num_samples, seed=args.seed)),
        eval_dataset=ListDataset(make_image_samples(script_args.num_eval_samples, seed=args.seed + 1)),
        data_collator=ImageCollator(),
        compute_metrics=accuracy,
        callbacks=[TokenStatsCallback()],  # logs the effective batch and samples/s of each step
    )
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    (batchnorm,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, BatchNormCallback)]
    summary = {
        "steps": float(result.global_step),
        "train_loss": float(result.training_loss),
        "eval_loss": float(metrics["eval_loss"]),
        "eval_accuracy": float(metrics["eval_accuracy"]),
        "batchnorm_recomputed": float(batchnorm.num_recomputed),
    }
    if trainer.is_world_process_zero():
        print(f"batchnorm={args.batchnorm}:", summary)
    return summary, trainer


def main(argv: list[str] | None = None) -> dict[str, float]:
    summary, trainer = train(argv)
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks
    return summary


if __name__ == "__main__":
    main()
