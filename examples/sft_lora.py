"""LoRA supervised fine-tuning of a causal LM with exact gradient accumulation (TRL's SFTTrainer with hf_gradacc in
front: GradAccSFTTrainer). The loss of every optimizer step is the mean over ALL its completion tokens, on any number
of processes and micro-batches.

    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/sft_lora.py \
        --model_name_or_path path/to/checkpoint --output_dir out/sft_lora --use_cpu true --bf16 false
    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml \
        examples/sft_lora.py --model_name_or_path path/to/checkpoint --output_dir out/sft_lora --bf16 false
    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/fsdp2_cpu.yaml \
        examples/sft_lora.py --model_name_or_path path/to/checkpoint --output_dir out/sft_lora --use_cpu true --bf16 false
    accelerate launch --config_file examples/accelerate_configs/zero2.yaml examples/sft_lora.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B --output_dir out/sft_lora --per_device_train_batch_size 4 \
        --gradient_accumulation_steps 8 --dataset_path my_data.jsonl          # GPUs
    python examples/sft_lora.py --model_name_or_path path/to/checkpoint --output_dir out/sft_lora --use_cpu true \
        --bf16 false --max_steps 2

``--model_name_or_path`` is a local directory written by ``save_pretrained`` (model and tokenizer) or a Hub id; the
model is loaded with ``AutoModelForCausalLM.from_pretrained`` and TRL wraps it in a LoRA adapter (``--lora_r``,
``--lora_alpha``, ``--lora_dropout``, ``--lora_target_modules``; ``--use_peft false`` trains every weight instead).
The data is a JSON / JSON-lines file of ``{"prompt": ..., "completion": ...}`` rows (``--dataset_path``), or a small
built-in set of such rows; the loss is on the completions only (TRL's default for prompt-completion data). Every
GradAccSFTConfig field (TRL's SFTConfig plus the hf_gradacc knobs) is a flag too.

On a CPU: ``--bf16 false`` (TRL's configs default to bf16); ``--use_cpu true`` with ddp_cpu.yaml and fsdp2_cpu.yaml, not
with the ZeRO configs; ``HF_GRADACC_CPU_DISTRIBUTED=1`` with the ZeRO and FSDP2 configs. Under ZeRO-3 the model is
loaded after the arguments are parsed, so it is partitioned as it loads. ``save_model()`` writes the adapter (or the
model) at the end; under FSDP2 only with ``fsdp_state_dict_type: FULL_STATE_DICT`` (fsdp2_cpu.yaml has it). See
docs/recipes.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset, load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from hf_gradacc.trl import GradAccSFTConfig, GradAccSFTTrainer

# A few prompt-completion rows, used without --dataset_path: what a run looks like, not a data set worth training on.
TOY_DATA: list[dict[str, str]] = [
    {"prompt": "What is the capital of France?", "completion": " Paris."},
    {"prompt": "Translate to German: good morning", "completion": " Guten Morgen."},
    {"prompt": "How many legs does a spider have?", "completion": " Eight."},
    {"prompt": "Name a primary colour.", "completion": " Red, blue or yellow."},
    {"prompt": "What is two plus three?", "completion": " Five."},
    {"prompt": "Give the opposite of hot.", "completion": " Cold."},
    {"prompt": "Which planet is known as the red planet and is the fourth from the sun?", "completion": " Mars."},
    {"prompt": "Complete the sequence: one, two, three,", "completion": " four, five, six, seven, eight."},
    {"prompt": "What do bees make?", "completion": " Honey."},
    {"prompt": "Spell the word cat backwards.", "completion": " t a c"},
    {"prompt": "What is the boiling point of water at sea level in degrees Celsius?", "completion": " One hundred."},
    {"prompt": "Say hello.", "completion": " Hello! How can I help you today?"},
]


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        metadata={"help": "A save_pretrained directory (model and tokenizer) or a Hub id of a causal LM."}
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "dtype the model is loaded in: float32, bfloat16, float16 or auto (the checkpoint's)."},
    )
    use_peft: bool = field(default=True, metadata={"help": "Train a LoRA adapter; false: fine-tune every weight."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the adapter is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "Modules that get an adapter: 'all-linear', or comma-separated names (q_proj,v_proj)."},
    )


@dataclass
class DataArguments:
    dataset_path: str | None = field(
        default=None,
        metadata={"help": "A JSON / JSON-lines file of {prompt, completion} rows; default: the built-in TOY_DATA."},
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training rows (quick runs, tests)."}
    )


def load_train_dataset(data_args: DataArguments) -> Dataset:
    if data_args.dataset_path is not None:
        dataset = load_dataset("json", data_files=data_args.dataset_path, split="train")
    else:
        dataset = Dataset.from_list(TOY_DATA)
    if data_args.max_train_samples is not None:
        dataset = dataset.select(range(min(data_args.max_train_samples, len(dataset))))
    return dataset


def lora_config(model_args: ModelArguments) -> Any:
    from peft import LoraConfig

    targets = model_args.lora_target_modules
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()],
    )


def build_trainer(argv: list[str] | None = None) -> GradAccSFTTrainer:
    """Parse the flags, load the model and tokenizer, and build the trainer (not trained yet)."""
    parser = HfArgumentParser((ModelArguments, DataArguments, GradAccSFTConfig))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    dtype = model_args.dtype if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    return GradAccSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=load_train_dataset(data_args),
        processing_class=tokenizer,
        peft_config=lora_config(model_args) if model_args.use_peft else None,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    trainer = build_trainer(argv)
    result = trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model()  # the adapter (adapter_model.safetensors), or the model with --use_peft false, in output_dir
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    summary = {"steps": result.global_step, "output_dir": trainer.args.output_dir, **(logs[-1] if logs else {})}
    if trainer.is_world_process_zero():
        print(json.dumps(summary))
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks
    return summary


if __name__ == "__main__":
    main()
