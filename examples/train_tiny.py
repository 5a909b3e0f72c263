"""Train a model with exact gradient accumulation: GradAccTrainer as a drop-in for Trainer.

Runs on the built-in tiny model by default (no download), or on your checkpoint with --model_name_or_path.

    python examples/train_tiny.py --output_dir out --max_steps 10
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/train_tiny.py --output_dir out \
        --use_cpu true
    python examples/train_tiny.py --output_dir out --task sequence_classification --gradient_accumulation_steps 8

Every GradAccConfig / TrainingArguments field is a flag (HfArgumentParser).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import HfArgumentParser

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.tiny import TASKS, ListDataset, PaddingCollator, build_tiny_model, make_samples


@dataclass
class ScriptArguments:
    task: str = field(default="causal_lm", metadata={"help": f"Built-in tiny task, one of {TASKS}."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A local checkpoint (save_pretrained) or Hub id instead of the tiny model."}
    )
    num_samples: int = field(default=64, metadata={"help": "Synthetic samples in the training set."})


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, GradAccConfig))
    script_args, training_args = parser.parse_args_into_dataclasses()
    if script_args.model_name_or_path is None:
        model = build_tiny_model(script_args.task)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    train_dataset = ListDataset(make_samples(script_args.task, script_args.num_samples, seed=training_args.seed))
    trainer = GradAccTrainer(
        model=model, args=training_args, train_dataset=train_dataset, data_collator=PaddingCollator()
    )
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)  # as run_clm.py does
    if trainer.is_world_process_zero():
        print(f"trained {result.global_step} steps, final train_loss {result.training_loss:.4f}")
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks


if __name__ == "__main__":
    main()
