"""Resume a causal-LM run with another layout (batch size, gradient_accumulation_steps, number of processes) and
check that every sample of the epoch is trained exactly once.

    # run A: GA 2, one epoch, a checkpoint every 2 steps (stop it after checkpoint-2, or let it finish)
    python examples/resume_with_new_layout.py --output_dir out --num_train_epochs 1 \
        --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --save_steps 2
    # run B: resumed from checkpoint-2 with GA 4 (one warning names "gradient_accumulation_steps 2 -> 4" and the
    # sample it continues from); the script prints each step's sample ids and "every sample trained once"
    python examples/resume_with_new_layout.py --output_dir out --num_train_epochs 1 \
        --per_device_train_batch_size 2 --gradient_accumulation_steps 4 --resume_from_checkpoint out/checkpoint-2
    # run A on 2 ranks instead, then run B on one process (the warning names "world_size 2 -> 1")
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/resume_with_new_layout.py \
        --output_dir out --use_cpu true --num_train_epochs 1 --gradient_accumulation_steps 2 --save_steps 2

The learning-rate schedule of run B is its own (its length counted in its layout) from its first step: the
checkpoint's optimizer holds the rate run A's schedule set for step 3, and hf_gradacc replaces it with run B's
before that step. Stopping run A with `--max_steps 2` gives checkpoint-2 too, but a run B that keeps A's layout then
resumes as the stock Trainer does: A's schedule ended at step 2, the optimizer holds the rate 0, and B's first
step trains at that rate.

The script is shaped like transformers' run_clm.py: HfArgumentParser over a ModelArguments dataclass and
hf_gradacc's GradAccConfig (every TrainingArguments and every hf_gradacc field is a flag), a `datasets.Dataset`
tokenized with `.map`, DataCollatorForLanguageModeling, GradAccTrainer. With no `--model_name_or_path` it writes a
tiny Llama and a word-level tokenizer to `<output_dir>/tiny_model` (no download).

Each sample carries an `id` column. The collator moves it into the batch as `sample_id`, and the trainer takes it out
again in `get_batch_samples` (before the forward) and appends, per optimizer step and rank, the ids that step
trained to `<output_dir>/sample_ids.rank<R>.jsonl`. A resumed run first drops the lines after its checkpoint's step
(run A may have gone on past it), so at the end the file holds exactly the steps that make up the final model, and
the script prints the verdict: "every sample trained once" per epoch, or what was lost or trained twice.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, HfArgumentParser

from hf_gradacc import GradAccConfig, GradAccTrainer


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A local causal LM folder; default: a tiny Llama written to the output_dir."}
    )
    num_samples: int = field(default=48, metadata={"help": "Synthetic documents in the training set."})
    block_size: int = field(default=24, metadata={"help": "Documents are truncated to this many tokens."})


WORDS = "the a cat dog sat ran on under mat log red blue big small and then".split()


def synthetic_texts(n: int) -> list[str]:
    """Documents of 3 to 20 words (mixed lengths, so padding and counted tokens differ between micro-batches)."""
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + (i * 5) % 18)) for i in range(n)]


class IdCollator:
    """Wraps a collator: the `id` of each feature goes into the batch as a `sample_id` tensor."""

    def __init__(self, collator) -> None:
        self.collator = collator

    def __call__(self, features):
        ids = [f.pop("id") for f in features]
        batch = self.collator(features)
        batch["sample_id"] = torch.tensor(ids)
        return batch


class SampleIdTrainer(GradAccTrainer):
    """Records the sample ids of every optimizer step on this rank (one JSON line per step)."""

    ids_path: Path

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        ids = [int(i) for batch in batches for i in batch.pop("sample_id").tolist()]  # never reaches the model
        if batches:
            step = {"step": self.state.global_step + 1, "epoch": int(self.state.epoch or 0), "ids": ids}
            with self.ids_path.open("a") as f:
                f.write(json.dumps(step) + "\n")
        return batches, num_items


def keep_steps_up_to(path: Path, last_step: int) -> None:
    """Drop the recorded steps after `last_step` (a resume retrains them)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= last_step]
        path.write_text("".join(line + "\n" for line in lines))


def verdict(output_dir: Path, num_samples: int) -> dict:
    """Every recorded step of every rank, and per epoch the ids missing or trained more than once."""
    steps: dict[int, list[int]] = {}
    epoch_of: dict[int, int] = {}
    for path in sorted(output_dir.glob("sample_ids.rank*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            steps.setdefault(row["step"], []).extend(row["ids"])
            epoch_of[row["step"]] = row["epoch"]
    per_epoch: dict[int, Counter] = {}
    for step, ids in steps.items():
        per_epoch.setdefault(epoch_of[step], Counter()).update(ids)
    report = {"steps": {s: sorted(ids) for s, ids in sorted(steps.items())}, "epochs": {}}
    for epoch, counts in sorted(per_epoch.items()):
        missing = sorted(set(range(num_samples)) - set(counts))
        twice = sorted(i for i, c in counts.items() if c > 1)
        report["epochs"][epoch] = {"missing": missing, "more_than_once": twice, "once": not missing and not twice}
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ModelArguments, GradAccConfig))
    model_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    training_args.remove_unused_columns = False  # keep `id`: the collator needs it (the trainer takes it out)
    output_dir = Path(training_args.output_dir)
    texts = synthetic_texts(model_args.num_samples)

    model_path = model_args.model_name_or_path
    if model_path is None:  # a tiny local checkpoint instead of a Hub download
        model_path = str(output_dir / "tiny_model")
        with training_args.main_process_first():  # the other ranks wait until rank 0 has written it
            if training_args.process_index == 0 and not (Path(model_path) / "config.json").exists():
                from hf_gradacc.testing.trl_steps import save_tiny_checkpoint

                save_tiny_checkpoint(model_path, texts)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)

    # run_clm-style: a datasets.Dataset, tokenized with .map (the `text` column removed, `id` kept)
    raw = Dataset.from_dict({"id": list(range(len(texts))), "text": texts})
    train_dataset = raw.map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=model_args.block_size),
        batched=True, remove_columns=["text"],
    )  # fmt: skip
    collator = IdCollator(DataCollatorForLanguageModeling(tokenizer, mlm=False))

    ids_path = output_dir / f"sample_ids.rank{training_args.process_index}.jsonl"
    resume = training_args.resume_from_checkpoint
    with training_args.main_process_first():
        if training_args.process_index == 0:
            output_dir.mkdir(parents=True, exist_ok=True)
            if resume:  # the steps after the checkpoint are trained again by this run: forget run A's record of them
                last_step = int(re.search(r"checkpoint-(\d+)", str(resume)).group(1))
                for path in output_dir.glob("sample_ids.rank*.jsonl"):
                    keep_steps_up_to(path, last_step)
            else:
                for path in output_dir.glob("sample_ids.rank*.jsonl"):
                    path.unlink()

    trainer = SampleIdTrainer(model=model, args=training_args, train_dataset=train_dataset, data_collator=collator)
    trainer.ids_path = ids_path
    result = trainer.train(resume_from_checkpoint=resume)

    report: dict = {"global_step": result.global_step, "train_loss": result.training_loss}
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():
        report.update(verdict(output_dir, len(train_dataset)))
        for step, ids in report["steps"].items():
            print(f"step {step}: samples {ids}")
        for epoch, v in report["epochs"].items():
            if v["once"]:
                print(f"epoch {epoch}: every sample trained once ({len(train_dataset)} samples)")
            else:
                print(f"epoch {epoch}: missing {v['missing']}, trained more than once {v['more_than_once']}")
        (output_dir / "verdict.json").write_text(json.dumps(report, indent=1))
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks
    return report


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
