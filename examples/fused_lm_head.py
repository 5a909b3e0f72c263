"""Completion-only causal-LM fine-tuning with the fused LM head: the head projects only the positions whose target
counts (not the prompt, not the padding), a tile at a time, and the update is the one the full logits give.

    python examples/fused_lm_head.py --output_dir out --fused_lm_head true --max_steps 4 --report_to none
    python examples/fused_lm_head.py --output_dir out --fused_lm_head false --max_steps 4 --report_to none
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/fused_lm_head.py \
        --output_dir out --use_cpu true --fused_lm_head true --max_steps 4 --report_to none

It runs on a tiny Llama with a 32,000-token vocabulary built from its config (no download; `--vocab_size` for
another) or on your causal LM (`--model_name_or_path`), with a run_clm-style `datasets.map` tokenization of its own
synthetic text, half of every document an ignored prompt; swap in your dataset and tokenizer. Every GradAccConfig
field is a flag (HfArgumentParser). It prints the LM-head rows computed per counted target (1.00 is the least: the
fused head), how the head's weight gradient reached `.grad` (added straight into it on micro-batches 2..N of a
window; on each window's first, written into the buffer kept from the window before) and the process's peak memory.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, LlamaConfig, LlamaForCausalLM

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.fused import into_grad as fused_into_grad
from hf_gradacc.testing.tiny import PaddingCollator, synthetic_clm_dataset


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A causal LM (local folder or Hub id) instead of the tiny Llama."}
    )
    vocab_size: int = field(default=32000, metadata={"help": "The tiny Llama's vocabulary."})
    num_samples: int = field(default=64, metadata={"help": "Synthetic documents in the training set."})
    prompt_fraction: float = field(default=0.5, metadata={"help": "Share of each document that is an ignored prompt."})


class HeadRowCounter:
    """LM-head rows computed in training forwards, and the counted targets of the batches the steps fetched."""

    def __init__(self, head: torch.nn.Module) -> None:
        self.rows = self.targets = 0
        head.register_forward_hook(self._count)

    def _count(self, _module, _args, output) -> None:
        if torch.is_grad_enabled():  # a training forward, not the start-up check's row (no gradient)
            fused = getattr(output, "fused_rows", None)  # 0 when a micro-batch has no counted target
            self.rows += output.shape[:-1].numel() if fused is None else fused

    def observe(self, batches) -> None:
        self.targets += sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in batches)


class CountingTrainer(GradAccTrainer):
    counter: HeadRowCounter

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.counter.observe(batches)
        return batches, num_items


def build_model(script_args: ScriptArguments, seed: int) -> torch.nn.Module:
    if script_args.model_name_or_path is not None:
        return AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=script_args.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ScriptArguments, GradAccConfig))
    script_args, args = parser.parse_args_into_dataclasses(args=argv)
    model = build_model(script_args, args.seed)
    train_dataset = synthetic_clm_dataset(  # swap in load_dataset(...) and your tokenizer
        script_args.num_samples, prompt_fraction=script_args.prompt_fraction, seed=args.seed,
        vocab_size=model.config.vocab_size,
    )  # fmt: skip
    trainer = CountingTrainer(model=model, args=args, train_dataset=train_dataset, data_collator=PaddingCollator())
    trainer.counter = HeadRowCounter(model.get_output_embeddings())
    stats = fused_into_grad.STATS = fused_into_grad.IntoGradStats()  # this run's counts only
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    counter = trainer.counter
    summary = {
        "global_step": result.global_step,
        "train_loss": result.training_loss,
        "head_rows_per_target": counter.rows / max(counter.targets, 1),
        "into_grad_writes": stats.written,  # micro-batches 2..N: the weight gradient added straight into .grad
        "kept_buffer_reused": stats.reused,  # windows 2..: the first micro-batch wrote into the kept buffer
        "peak_memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "parameters": torch.cat([p.detach().reshape(-1) for p in trainer.accelerator.unwrap_model(model).parameters()]),
    }
    if trainer.is_world_process_zero():
        print(
            f"trained {summary['global_step']} steps, train_loss {summary['train_loss']:.4f}, "
            f"LM-head rows per counted target {summary['head_rows_per_target']:.2f}, weight gradient into .grad "
            f"on {stats.written} micro-batches, kept buffer reused on {stats.reused} windows, "
            f"peak memory {summary['peak_memory_mib']:,.0f} MiB (fused_lm_head={args.fused_lm_head})"
        )
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks
    return summary


if __name__ == "__main__":
    main()
