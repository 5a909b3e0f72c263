"""Exact gradient accumulation for a Trainer your framework builds: `make_exact(trainer)` after it is constructed.

    python examples/make_exact.py --output_dir out --gradient_accumulation_steps 8 --max_steps 10
    python examples/make_exact.py --output_dir out --gradient_accumulation_steps 8 --make_exact false  # the stock step
    python examples/make_exact.py --output_dir out --regroup_micro_batches true       # an hf_gradacc knob, as a flag
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/make_exact.py \
        --output_dir out --use_cpu true

`build_framework_trainer` below stands for code you do not write (a fine-tuning framework, a larger codebase): it
defines its own `Trainer` subclass, whose `compute_loss` returns the model's loss, the MEAN over the micro-batch, and
builds it. With accumulation that mean is summed over the micro-batches of a step, and a micro-batch of 3 target
tokens weighs as much as one of 300. `make_exact(trainer)` switches the built trainer to hf_gradacc's step: the
framework's own methods, callbacks and logging stay, and the step over N micro-batches equals one full-batch step.

It runs on the built-in tiny Llama (no download) or on your causal LM (`--model_name_or_path`), on synthetic text
tokenized with `datasets.map` the way run_clm does (swap in your dataset and tokenizer). `TrainingArguments` and the
hf_gradacc knobs (`GradAccArguments`) are flags (HfArgumentParser).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments

from hf_gradacc import GradAccArguments, make_exact
from hf_gradacc.testing.tiny import VOCAB_SIZE, PaddingCollator, build_tiny_model, synthetic_clm_dataset


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A causal LM (local folder or Hub id) instead of the built-in tiny Llama."}
    )
    num_samples: int = field(default=96, metadata={"help": "Synthetic documents in the training set."})
    make_exact: bool = field(default=True, metadata={"help": "Make the framework's trainer exact (false: stock step)."})


# ---------------------------------------------------------------------------------------------- "the framework"
def build_framework_trainer(model, args: TrainingArguments, train_dataset) -> Trainer:
    """What a framework does from its config file: its own Trainer subclass, constructed and returned."""

    class FrameworkTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)  # the model's own loss: the mean over this micro-batch's target tokens
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    return FrameworkTrainer(model=model, args=args, train_dataset=train_dataset, data_collator=PaddingCollator())


# ---------------------------------------------------------------------------------------------- the script
def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments, GradAccArguments))
    script_args, training_args, knobs = parser.parse_args_into_dataclasses(args=argv)
    if script_args.model_name_or_path is None:
        model, vocab_size = build_tiny_model("causal_lm", seed=training_args.seed), VOCAB_SIZE
    else:
        model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
        vocab_size = model.config.vocab_size
    train_dataset = synthetic_clm_dataset(script_args.num_samples, seed=training_args.seed, vocab_size=vocab_size)

    trainer = build_framework_trainer(model, training_args, train_dataset)
    if script_args.make_exact:
        make_exact(trainer, **dataclasses.asdict(knobs))  # in place, before train()

    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    log = next((entry for entry in reversed(trainer.state.log_history) if "loss" in entry), {})
    summary = {"steps": result.global_step, "trainer": type(trainer).__name__, **log}
    if trainer.is_world_process_zero():
        print(f"{summary['trainer']}: trained {result.global_step} steps, final train_loss {result.training_loss:.4f}")
    return summary


if __name__ == "__main__":
    main()
