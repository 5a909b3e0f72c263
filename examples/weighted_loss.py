"""Weighted causal-LM fine-tuning: every document carries a weight (a `loss_weights` dataset column, one number per
sample; per-token lists work the same way), and each optimizer step minimises sum_i w_i * loss_i / sum_i w_i over
the counted targets of ALL its micro-batches on every rank, whatever the batch size, GA and number of ranks.

    python examples/weighted_loss.py --output_dir out --max_steps 4 --report_to none
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/weighted_loss.py \
        --output_dir out --use_cpu true --max_steps 4 --report_to none

It trains a tiny Llama built from its config (no download) on a run_clm-style synthetic dataset whose documents get
a weight from their "source" (a cleaner source weighs more; one source weighs 0: its documents are never learned and
never counted); swap in your dataset and tokenizer. Before training it runs ONE SGD(lr=1) step of the same setup and
prints its relative gradient error against the float64 full-batch weighted loss (hf_gradacc/testing/reference.py):
1e-7 here, where the usual per-micro-batch weighted mean is off by percents.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import PaddingCollator, build_tiny_model, synthetic_clm_dataset
from hf_gradacc.weights import LOSS_WEIGHTS_KEY, LossWeightsCollator

SOURCE_WEIGHTS = (2.0, 1.0, 0.5, 0.0)  # one weight per synthetic "source"; documents take their source's


@dataclass
class ScriptArguments:
    num_samples: int = field(default=64, metadata={"help": "Synthetic documents in the training set."})
    prompt_fraction: float = field(default=0.3, metadata={"help": "Share of each document that is an ignored prompt."})


def weighted_dataset(num_samples: int, prompt_fraction: float, seed: int = 0):
    """The synthetic documents with a `loss_weights` column: document i comes from source i % 4."""
    dataset = synthetic_clm_dataset(num_samples, prompt_fraction=prompt_fraction, seed=seed)
    return dataset.map(lambda row, i: {LOSS_WEIGHTS_KEY: SOURCE_WEIGHTS[i % len(SOURCE_WEIGHTS)]}, with_indices=True)


def check_one_step(config: GradAccConfig, samples: list[dict]) -> float:
    """One SGD(lr=1) step over one window of ``samples``: its relative error against the float64 full batch."""
    model = build_tiny_model("causal_lm", seed=config.seed)
    window = config.per_device_train_batch_size * config.gradient_accumulation_steps * config.world_size
    samples = samples[:window]
    args = one_step_args(tempfile.mkdtemp(prefix="weighted_check_"), args_class=GradAccConfig,
                         per_device_train_batch_size=config.per_device_train_batch_size,
                         gradient_accumulation_steps=config.gradient_accumulation_steps, use_cpu=config.use_cpu)  # fmt: skip
    collate = LossWeightsCollator(PaddingCollator())
    update, _ = one_step_update(GradAccTrainer, model, samples, args, data_collator=collate)
    return compare_with_reference(update, model, samples, "causal_lm", data_collator=collate).relative_error


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = HfArgumentParser((ScriptArguments, GradAccConfig))
    script, config = parser.parse_args_into_dataclasses(args=argv)
    dataset = weighted_dataset(script.num_samples, script.prompt_fraction, seed=config.seed)
    samples = [dict(row) for row in dataset]
    error = check_one_step(config, samples) if config.world_size == 1 else float("nan")
    print(f"one step against the float64 full batch: relative error {error:.1e}")
    model = build_tiny_model("causal_lm", seed=config.seed)
    trainer = GradAccTrainer(model=model, args=config, train_dataset=dataset,
                             data_collator=LossWeightsCollator(PaddingCollator()))  # fmt: skip
    initial = copy.deepcopy(model.state_dict())
    result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    changed = any(not torch.equal(initial[k], v) for k, v in model.state_dict().items())
    print(f"trained {trainer.state.global_step} steps, weighted train loss {result.training_loss:.4f}")
    return {"relative_error": error, "steps": trainer.state.global_step, "train_loss": result.training_loss,
            "changed": changed}  # fmt: skip


if __name__ == "__main__":
    main()
