"""Causal-LM fine-tuning with an accumulation schedule: small optimizer steps first, the full batch later, and the
learning rate following the batch.

    python examples/accumulation_schedule.py --output_dir out --gradient_accumulation_steps 8 \
        --accumulation_schedule "0:1,10:4,30:8" --lr_scaling sqrt --learning_rate 3e-3 --num_train_epochs 2 --logging_steps 1
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/accumulation_schedule.py \
        --output_dir out --use_cpu true --gradient_accumulation_steps 8 --accumulation_schedule "0:1,10:4,30:8" \
        --lr_scaling sqrt --logging_steps 1

Steps 0-9 accumulate 1 micro-batch per rank, steps 10-29 accumulate 4 and every later step 8; with
``--lr_scaling sqrt`` the scheduler's rate is multiplied by sqrt(GA / 8) (8 = ``--gradient_accumulation_steps``,
the accumulation the rate is set for). Every step is exact for its own window; the log shows
``accumulation_steps``, ``effective_batch_size`` (samples of the step, all ranks) and the ``learning_rate`` the step
used. It runs on the built-in tiny Llama (no download) or on your causal LM (``--model_name_or_path``), with a
run_clm-style ``datasets.map`` tokenization of its own synthetic text (a byte-level "tokenizer" keeps it offline).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import AutoModelForCausalLM, HfArgumentParser

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.tiny import VOCAB_SIZE, PaddingCollator, build_tiny_model, synthetic_clm_dataset


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A causal LM (local folder or Hub id) instead of the built-in tiny Llama."}
    )
    num_samples: int = field(default=160, metadata={"help": "Synthetic documents in the training set."})
    prompt_fraction: float = field(default=0.3, metadata={"help": "Share of each document that is an ignored prompt."})


def main(argv: list[str] | None = None, callbacks: list | None = None) -> dict:
    parser = HfArgumentParser((ScriptArguments, GradAccConfig))
    script_args, args = parser.parse_args_into_dataclasses(args=argv)
    if script_args.model_name_or_path is None:
        model, vocab_size = build_tiny_model("causal_lm", seed=args.seed), VOCAB_SIZE
    else:
        model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
        vocab_size = model.config.vocab_size
    train_dataset = synthetic_clm_dataset(  # swap in load_dataset(...) and your tokenizer
        script_args.num_samples, prompt_fraction=script_args.prompt_fraction, seed=args.seed, vocab_size=vocab_size, mean_log_words=2.3
    )
    trainer = GradAccTrainer(
        model=model, args=args, train_dataset=train_dataset, data_collator=PaddingCollator(), callbacks=callbacks
    )
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    steps = [h for h in trainer.state.log_history if "accumulation_steps" in h]
    if trainer.is_world_process_zero():
        for h in steps:
            print(
                f"step {h['step']:>3}  accumulation {int(h['accumulation_steps']):>2}  effective batch "
                f"{int(h['effective_batch_size']):>4}  lr {h['learning_rate']:.3g}  loss {h['loss']:.4f}"
            )
        print(f"trained {result.global_step} steps ({trainer.state.max_steps} planned), train_loss {result.training_loss:.4f}")
    summary = {"global_step": result.global_step, "max_steps": trainer.state.max_steps, "logs": steps, "model": model}
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks
    return summary


if __name__ == "__main__":
    main()
