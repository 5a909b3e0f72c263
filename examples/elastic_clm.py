"""Elastic and preemptible causal-LM training, shaped like transformers' run_clm.py: every (re)start resumes from the
last complete checkpoint of `--output_dir`, on however many processes are there.

    # torchrun elastic: 1 to 2 nodes, restarted up to 3 times (a node lost or added restarts every worker; a node
    # that joins needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 with torch 2.13, docs/elastic.md says why)
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    torchrun --nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint $HOST:29400 --rdzv-id job1 \
        --max-restarts 3 examples/elastic_clm.py --output_dir out --save_steps 2 --save_on_preemption true \
        --ddp_timeout 60 --use_cpu true --max_steps 20
    # one process, the same script (a SIGTERM, e.g. `kill <pid>`, saves at the end of the step in flight)
    python examples/elastic_clm.py --output_dir out --save_steps 2 --save_on_preemption true --max_steps 20

docs/elastic.md has the SLURM, submitit, Kubernetes and SkyPilot recipes around it; tests/distributed/
test_elastic.py runs the torchrun line on one host with one of two agents killed, and with a second agent joining one
that started alone.

What it does, as run_clm.py does: HfArgumentParser over a ModelArguments dataclass and hf_gradacc's GradAccConfig
(every TrainingArguments and hf_gradacc field is a flag), `get_last_checkpoint(output_dir)`, a `datasets.Dataset`
tokenized with `.map`, DataCollatorForLanguageModeling, GradAccTrainer. When get_last_checkpoint finds a checkpoint,
the run resumes from `latest_complete_checkpoint(output_dir)`: the newest COMPLETE one, the same on every rank (a
save killed midway, which get_last_checkpoint would return, is passed over). With no `--model_name_or_path` it writes a
tiny Llama and a word-level tokenizer to `<output_dir>/tiny_model` (no download).

Every start appends one JSON line to `<output_dir>/starts.jsonl` (rank 0): the torchrun restart count, the world
size, the checkpoint it resumed from, then a second line when `train()` returns: the step reached and whether it
finished or was preempted. A finished run saves the model and `train_results.json` (what an sbatch script checks
before requeueing); a preempted one (`trainer.preempted`) exits 0 without them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    TrainerCallback,
)
from transformers.trainer_utils import get_last_checkpoint

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.checkpoints import latest_complete_checkpoint


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A local causal LM folder; default: a tiny Llama written to the output_dir."}
    )
    num_samples: int = field(default=256, metadata={"help": "Synthetic documents in the training set."})
    block_size: int = field(default=24, metadata={"help": "Documents are truncated to this many tokens."})
    seconds_per_step: float = field(
        default=0.0, metadata={"help": "Make each optimizer step last at least this long (to watch a kill; 0: off)."}
    )


WORDS = "the a cat dog sat ran on under mat log red blue big small and then".split()


def synthetic_texts(n: int) -> list[str]:
    """Documents of 3 to 20 words (mixed lengths, so padding and counted tokens differ between micro-batches)."""
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + (i * 5) % 18)) for i in range(n)]


class SlowSteps(TrainerCallback):
    """Each optimizer step lasts at least `seconds` (a demo of a kill between checkpoints)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.began = seconds, time.monotonic()

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(max(0.0, self.seconds - (time.monotonic() - self.began)))


def record(output_dir: Path, **fields) -> None:
    with (output_dir / "starts.jsonl").open("a") as f:
        f.write(json.dumps({"time": time.time(), **fields}) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ModelArguments, GradAccConfig))
    model_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    output_dir = Path(training_args.output_dir)
    texts = synthetic_texts(model_args.num_samples)

    # run_clm.py: the last checkpoint of output_dir, unless it is to be overwritten
    last_checkpoint = None
    if output_dir.is_dir() and not getattr(training_args, "overwrite_output_dir", False):
        last_checkpoint = get_last_checkpoint(str(output_dir))

    model_path = model_args.model_name_or_path
    if model_path is None:  # a tiny local checkpoint instead of a Hub download
        model_path = str(output_dir / "tiny_model")
        with training_args.main_process_first():  # the other ranks wait until rank 0 has written it
            if training_args.process_index == 0 and not (Path(model_path) / "config.json").exists():
                from hf_gradacc.testing.trl_steps import save_tiny_checkpoint

                save_tiny_checkpoint(model_path, texts)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    raw = Dataset.from_dict({"text": texts})
    train_dataset = raw.map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=model_args.block_size),
        batched=True,
        remove_columns=["text"],
    )
    callbacks = [SlowSteps(model_args.seconds_per_step)] if model_args.seconds_per_step > 0 else []
    trainer = GradAccTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=callbacks,
    )
    resume = None
    if last_checkpoint is not None:  # the newest COMPLETE checkpoint, the same on every rank (a killed save passed over)
        world, rank = training_args.world_size, training_args.process_index
        resume = latest_complete_checkpoint(str(output_dir), world_size=world, rank=rank)
    main_process = trainer.is_world_process_zero()
    start = {
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "world_size": training_args.world_size,
        "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
        "resumed_from": resume and os.path.basename(resume),
    }
    if main_process:
        record(output_dir, event="start", **start)
    result = trainer.train(resume_from_checkpoint=resume)
    report = {**start, "global_step": result.global_step, "preempted": trainer.preempted}
    if main_process:
        record(output_dir, event="preempted" if trainer.preempted else "finished", **report)
    if not trainer.preempted:  # a finished run: the model and its metrics (an sbatch script checks for them)
        trainer.save_model()
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks
    return report


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
