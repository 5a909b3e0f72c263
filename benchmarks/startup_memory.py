"""Process peak memory of ONE optimizer step, first step included: the stock Trainer against GradAccTrainer at a
151,936-token vocabulary (as in Qwen models), the table of issue 17 (CPU; each configuration in its own process).

    python benchmarks/startup_memory.py                        # the four configurations of the issue
    python benchmarks/startup_memory.py --configs stock_4x2,gradacc_4x2 --json startup_memory.json

What is measured: the process's peak resident set (``ru_maxrss``) at the end of a run that builds the model and the
data, and trains ONE optimizer step (SGD, lr 1, no momentum, weight decay or clipping: the parameter update is minus
the step's accumulated gradient). Nothing is excluded: the first step, with the start-up loss check, is the step.
glibc's mmap threshold is fixed at 32 KiB, so freed tensors leave the resident set and the peak is what was live at
once. The ratios are against the stock ``Trainer`` at the same micro-batch (4 x GA 2) measured in the same run; the
update of every configuration is compared with the stock 8 x GA 1 update (one batch of all 8 samples).

Model: a Llama causal LM, hidden 64, 2 layers, 151,936-token vocabulary, untied embeddings, fp32, eager attention.
Data: 8 samples of 200-500 random tokens, the first half of each labelled -100 (completion-only fine-tuning).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
from typing import Any

# name: (trainer, micro-batch, accumulation steps, GradAccArguments)
CONFIGS: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "stock_4x2": ("Trainer", 4, 2, {}),
    "stock_8x1": ("Trainer", 8, 1, {}),
    "gradacc_4x2": ("GradAccTrainer", 4, 2, {}),
    "gradacc_4x2_nocheck": ("GradAccTrainer", 4, 2, {"check_loss_at_start": False}),
    "gradacc_4x2_fused": ("GradAccTrainer", 4, 2, {"fused_lm_head": True}),
    "gradacc_4x2_unfused": ("GradAccTrainer", 4, 2, {"fused_lm_head": False}),
}
LABELS = {
    "stock_4x2": "stock `Trainer`, 4 x GA 2",
    "stock_8x1": "stock `Trainer`, 8 x GA 1",
    "gradacc_4x2": "`GradAccTrainer`, 4 x GA 2, defaults (`fused_lm_head=None`: automatic)",
    "gradacc_4x2_nocheck": "`GradAccTrainer`, 4 x GA 2, `check_loss_at_start=False`",
    "gradacc_4x2_fused": "`GradAccTrainer`, 4 x GA 2, `fused_lm_head=True`",
    "gradacc_4x2_unfused": "`GradAccTrainer`, 4 x GA 2, `fused_lm_head=False`",
}
BASELINE, FULL_BATCH = "stock_4x2", "stock_8x1"


def _samples(opts: argparse.Namespace) -> list[dict[str, list[int]]]:
    rng = random.Random(opts.seed)
    samples = []
    for _ in range(opts.num_samples):
        length = rng.randint(opts.min_length, opts.max_length)
        ids = [rng.randint(2, opts.vocab_size - 1) for _ in range(length)]
        samples.append({"input_ids": ids, "labels": [-100] * (length // 2) + ids[length // 2 :]})
    return samples


def run_one(opts: argparse.Namespace) -> dict[str, Any]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 32 * 1024)  # M_MMAP_THRESHOLD: large tensors are mmap'd and handed back on free
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from hf_gradacc import GradAccTrainer
    from hf_gradacc.testing.tiny import ListDataset, PaddingCollator

    torch.set_num_threads(1)
    trainer_name, batch_size, accumulation, gradacc_args = CONFIGS[opts.worker]
    torch.manual_seed(opts.seed)
    config = LlamaConfig(
        vocab_size=opts.vocab_size, hidden_size=opts.hidden_size, intermediate_size=2 * opts.hidden_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    initial = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="startup_memory_"), per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation, max_steps=1, optim="sgd", learning_rate=1.0, weight_decay=0.0,
        max_grad_norm=0.0, lr_scheduler_type="constant", use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=opts.seed, dataloader_drop_last=False,
    )  # fmt: skip
    kwargs: dict[str, Any] = dict(model=model, args=args, train_dataset=ListDataset(_samples(opts)),
                                  data_collator=PaddingCollator())  # fmt: skip
    if trainer_name == "GradAccTrainer":
        trainer: Any = GradAccTrainer(**kwargs, gradacc_args=gradacc_args)
    else:
        trainer = Trainer(**kwargs)
    before_train = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    update = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - initial
    torch.save(update, opts.update_file)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"config": opts.worker, "peak_rss": peak, "peak_rss_before_train": before_train,
            "loss": logs[-1]["loss"] if logs else None}  # fmt: skip


def _versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers

    import hf_gradacc

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "hf_gradacc": hf_gradacc.__version__}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--vocab_size", type=int, default=151936)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_samples", type=int, default=8)
    parser.add_argument("--min_length", type=int, default=200)
    parser.add_argument("--max_length", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the runs and the ratios to this file")
    parser.add_argument("--worker", choices=list(CONFIGS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--update_file", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker is not None:
        print("RESULT " + json.dumps(run_one(opts)), flush=True)
        return {}

    names = [n.strip() for n in opts.configs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    keys = ("vocab_size", "hidden_size", "num_samples", "min_length", "max_length", "seed")
    forwarded = [item for key in keys for item in (f"--{key}", str(getattr(opts, key)))]
    workdir = tempfile.mkdtemp(prefix="startup_memory_updates_")
    runs: dict[str, dict[str, Any]] = {}
    for name in names:  # one configuration at a time: no run shares the machine with another
        update_file = os.path.join(workdir, f"{name}.pt")
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", name, "--update_file", update_file],
            env=env, capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{name} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        runs[name] = {**json.loads(lines[-1][len("RESULT ") :]), "update_file": update_file}
        print(f"{name}: peak {runs[name]['peak_rss'] / 1e6:,.0f} MB", flush=True)

    import torch

    reference = torch.load(runs[FULL_BATCH]["update_file"]) if FULL_BATCH in runs else None
    rows = []
    for name in names:
        run = runs[name]
        ratio = run["peak_rss"] / runs[BASELINE]["peak_rss"] if BASELINE in runs else None
        diff = None
        if reference is not None:
            update = torch.load(run["update_file"])
            diff = float((update.double() - reference.double()).norm() / reference.double().norm())
        rows.append({"config": name, "label": LABELS[name], "peak_rss_mb": run["peak_rss"] / 1e6,
                     "peak_rss_before_train_mb": run["peak_rss_before_train"] / 1e6, "ratio_vs_stock_4x2": ratio,
                     "update_diff_vs_stock_8x1": diff})  # fmt: skip
    print("\n| run | peak memory | vs stock 4 x GA 2 | update vs stock 8 x GA 1 |\n| --- | --- | --- | --- |")
    for row in rows:
        ratio = "n/a" if row["ratio_vs_stock_4x2"] is None else f"{row['ratio_vs_stock_4x2']:.3f}x"
        diff = "n/a" if row["update_diff_vs_stock_8x1"] is None else f"{row['update_diff_vs_stock_8x1']:.1e}"
        print(f"| {row['label']} | {row['peak_rss_mb']:,.0f} MB | {ratio} | {diff} |")
    result = {"settings": {k: v for k, v in vars(opts).items() if k not in ("json", "worker", "update_file")},
              "versions": _versions(), "rows": rows}  # fmt: skip
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
