"""DPO with exact gradient accumulation: TRL's DPOTrainer with hf_gradacc in front (GradAccDPOTrainer).

Stock TRL averages the micro-batch means and divides by the accumulation steps, so a step whose micro-batches hold
different numbers of pairs (the epoch's last one, several processes) weighs pairs unequally; here every step is the
mean over all of its pairs. Runs on a tiny local model by default (built from a config, saved with save_pretrained,
then loaded by TRL from that path like any checkpoint; TRL loads the reference model from the same path).

    python examples/dpo.py --output_dir out/dpo --per_device_train_batch_size 2 --gradient_accumulation_steps 4 \
        --max_steps 2 --use_cpu true --bf16 false
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/dpo.py --output_dir out/dpo \
        --use_cpu true --bf16 false
    python examples/dpo.py --output_dir out/dpo --model_name_or_path path/to/checkpoint --dataset_path pairs.jsonl

Every GradAccDPOConfig field (TRL's DPOConfig plus the hf_gradacc knobs) is a flag. TRL's configs default to bf16:
on a CPU, `--bf16 false` keeps the step in float32.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

from datasets import Dataset, load_dataset
from transformers import AutoTokenizer, HfArgumentParser

from hf_gradacc.testing.trl_steps import save_tiny_checkpoint, word
from hf_gradacc.trl import GradAccDPOConfig, GradAccDPOTrainer

# the tiny model's words (ids 3 ... after <pad>, </s>, <unk>)
TINY_WORDS = [word(i) for i in range(3, 96)]


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A checkpoint directory (save_pretrained) with its tokenizer; default: a tiny model built "
                  "and saved in <output_dir>/tiny-model."},
    )  # fmt: skip
    dataset_path: str | None = field(
        default=None,
        metadata={"help": "A JSON / JSON-lines file of {prompt, chosen, rejected}; default: synthetic pairs."},
    )
    num_pairs: int = field(default=7, metadata={"help": "Synthetic preference pairs (without --dataset_path)."})


def synthetic_pairs(num_pairs: int, *, seed: int = 0) -> list[dict[str, str]]:
    """Prompts and completions of mixed lengths over the tiny vocabulary; every completion ends with </s>."""
    rng = random.Random(seed)
    words = TINY_WORDS

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    return [
        {"prompt": text(rng.randint(1, 8)), "chosen": f" {text(rng.randint(1, 6))} </s>",
         "rejected": f" {text(rng.randint(1, 6))} </s>"}
        for _ in range(num_pairs)
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = HfArgumentParser((ScriptArguments, GradAccDPOConfig))
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
        train_dataset = Dataset.from_list(synthetic_pairs(script_args.num_pairs, seed=training_args.seed))

    trainer = GradAccDPOTrainer(
        model=path,  # TRL loads the policy, and the reference model, from the checkpoint
        args=training_args,
        train_dataset=train_dataset,
        processing_class=AutoTokenizer.from_pretrained(path),
    )
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    summary = {"steps": result.global_step, "model_path": path, **(logs[-1] if logs else {})}
    if trainer.is_world_process_zero():
        print(json.dumps(summary))
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks
    return summary


if __name__ == "__main__":
    main()
