"""GRPO with exact gradient accumulation: TRL's GRPOTrainer with hf_gradacc in front (GradAccGRPOTrainer).

Stock TRL divides each micro-batch's loss by a count of its generation batch (``dapo``: the generation batch's
completion tokens rescaled to one step; ``bnpo``: the micro-batch's own tokens, then by the accumulation steps), which
is the optimizer step's count only when one generation batch is exactly one step and, for ``bnpo``, every micro-batch
holds as many completion tokens. Here the completions are generated when the step's micro-batches are fetched, counted
over every micro-batch and process, and every step is the mean over ALL its completion tokens (or sequences, by
``--loss_type``), whatever ``--steps_per_generation`` and ``--num_iterations``. ``hf-gradacc check --trainer grpo``
checks every ``--loss_type`` against its float64 definition (docs/rl.md); ``bnpo``'s "local batch" is the whole step
here, so a ``bnpo`` step is a ``dapo`` step.

    python examples/grpo.py --output_dir out/grpo --use_cpu true --bf16 false --max_steps 2 --logging_steps 1 \
        --per_device_train_batch_size 2 --gradient_accumulation_steps 4 --num_generations 2 \
        --steps_per_generation 8 --max_completion_length 8 --loss_type bnpo
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/grpo.py --output_dir out/grpo \
        --use_cpu true --bf16 false --max_steps 2 --logging_steps 1 --per_device_train_batch_size 2 \
        --gradient_accumulation_steps 4 --num_generations 2 --max_completion_length 8
    python examples/grpo.py --output_dir out/grpo --model_name_or_path path/to/checkpoint --dataset_path prompts.jsonl

By default a tiny Llama over a vocabulary of 8 words is built and saved in ``<output_dir>/tiny-model`` (TRL loads it
from that path like any checkpoint); it ends a completion with </s> about once in 8 tokens, so completions have many
lengths. The reward is deterministic: ``-|words - target| / target`` with ``--target_words`` (default 4). Every
GradAccGRPOConfig field (TRL's GRPOConfig plus the hf_gradacc knobs) is a flag; on a CPU, ``--bf16 false`` keeps the
step in float32 (TRL's configs default to bf16).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from datasets import Dataset, load_dataset
from transformers import AutoTokenizer, HfArgumentParser

from hf_gradacc.testing.trl_steps import save_tiny_checkpoint, word
from hf_gradacc.trl import GradAccGRPOConfig, GradAccGRPOTrainer

# the tiny model's words (ids 3 ... after <pad>, </s>, <unk>)
TINY_WORDS = [word(i) for i in range(3, 8)]


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A checkpoint directory (save_pretrained) with its tokenizer, or a Hub id; default: a tiny "
                  "model built and saved in <output_dir>/tiny-model."},
    )  # fmt: skip
    dataset_path: str | None = field(
        default=None, metadata={"help": "A JSON / JSON-lines file of {prompt} rows; default: synthetic prompts."}
    )
    num_prompts: int = field(default=16, metadata={"help": "Synthetic prompts (without --dataset_path)."})
    target_words: int = field(default=4, metadata={"help": "The completion length (in words) the reward favours."})


def synthetic_prompts(num_prompts: int, *, seed: int = 0) -> list[dict[str, str]]:
    """Prompts of 1-5 words over the tiny vocabulary."""
    rng = random.Random(seed)
    words = TINY_WORDS
    return [{"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(1, 5)))} for _ in range(num_prompts)]


def length_reward(target_words: int):
    """A reward function for TRL: ``-|words - target| / target`` per completion (deterministic)."""

    def reward(completions: Sequence[str], **kwargs: Any) -> list[float]:
        return [-abs(len(completion.split()) - target_words) / target_words for completion in completions]

    reward.__name__ = "length_reward"  # TRL logs it as rewards/length_reward/mean
    return reward


def build_trainer(argv: list[str] | None = None) -> GradAccGRPOTrainer:
    parser = HfArgumentParser((ScriptArguments, GradAccGRPOConfig))
    script_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    path = script_args.model_name_or_path
    if path is None:
        path = os.path.join(training_args.output_dir, "tiny-model")
        if training_args.process_index == 0:
            save_tiny_checkpoint(path, [" ".join(TINY_WORDS)], seed=training_args.seed)
        training_args.distributed_state.wait_for_everyone()
    if script_args.dataset_path is not None:
        train_dataset = load_dataset("json", data_files=script_args.dataset_path, split="train")
    else:
        train_dataset = Dataset.from_list(synthetic_prompts(script_args.num_prompts, seed=training_args.seed))
    return GradAccGRPOTrainer(
        model=path,  # TRL loads the policy from the checkpoint
        reward_funcs=length_reward(script_args.target_words),
        args=training_args,
        train_dataset=train_dataset,
        processing_class=AutoTokenizer.from_pretrained(path, padding_side="left"),  # GRPO generates left-padded
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    trainer = build_trainer(argv)
    result = trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    summary = {"steps": result.global_step, "train_loss": result.training_loss, **(logs[-1] if logs else {})}
    if trainer.is_world_process_zero():
        print(json.dumps(summary))
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks
    return summary


if __name__ == "__main__":
    main()
