"""Causal-LM fine-tuning with packed micro-batches: every micro-batch is ONE padding-free row of whole samples, the
optimizer step keeps exactly its samples, and the update equals the padded run's.

    python examples/packed_clm.py --output_dir out --pack_micro_batches true --max_tokens_per_micro_batch 512
    python examples/packed_clm.py --output_dir out --pack_micro_batches false        # the same steps, padded
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/packed_clm.py \
        --output_dir out --use_cpu true --pack_micro_batches true

It runs on the built-in tiny Llama (no download) or on your causal LM (`--model_name_or_path`, a local folder or a
Hub id), with a run_clm-style `datasets.map` tokenization of its own synthetic text (a byte-level "tokenizer" keeps
it offline); swap in your dataset and tokenizer. Every GradAccConfig field is a flag (HfArgumentParser).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.tiny import VOCAB_SIZE, PaddingCollator, build_tiny_model, synthetic_clm_dataset


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A causal LM (local folder or Hub id) instead of the built-in tiny Llama."}
    )
    num_samples: int = field(default=96, metadata={"help": "Synthetic documents in the training set."})
    prompt_fraction: float = field(default=0.3, metadata={"help": "Share of each document that is an ignored prompt."})


class TokenCounter:
    """Token positions computed vs real tokens, from the batches each step fetched (the padding packing removes)."""

    def __init__(self) -> None:
        self.computed = self.real = 0

    def observe(self, batches) -> None:
        for batch in batches:
            self.computed += int(batch["input_ids"].numel())
            mask = batch.get("attention_mask")
            self.real += int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())


class CountingTrainer(GradAccTrainer):
    counter: TokenCounter

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.counter.observe(batches)
        return batches, num_items


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ScriptArguments, GradAccConfig))
    script_args, args = parser.parse_args_into_dataclasses(args=argv)
    if script_args.model_name_or_path is None:
        model, vocab_size = build_tiny_model("causal_lm", seed=args.seed), VOCAB_SIZE
    else:
        model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
        vocab_size = model.config.vocab_size
    train_dataset = synthetic_clm_dataset(  # swap in load_dataset(...) and your tokenizer
        script_args.num_samples, prompt_fraction=script_args.prompt_fraction, seed=args.seed, vocab_size=vocab_size
    )
    trainer = CountingTrainer(model=model, args=args, train_dataset=train_dataset, data_collator=PaddingCollator())
    trainer.counter = TokenCounter()
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    summary = {
        "global_step": result.global_step,
        "train_loss": result.training_loss,
        "computed_per_real_token": trainer.counter.computed / max(trainer.counter.real, 1),
        "parameters": torch.cat([p.detach().reshape(-1) for p in trainer.accelerator.unwrap_model(model).parameters()]),
    }
    if trainer.is_world_process_zero():
        print(
            f"trained {summary['global_step']} steps, train_loss {summary['train_loss']:.4f}, "
            f"computed / real tokens {summary['computed_per_real_token']:.3f}"
        )
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks
    return summary


if __name__ == "__main__":
    main()
