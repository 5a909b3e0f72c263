"""Peak memory of one SFT optimizer step: TRL's SFTTrainer against hf_gradacc's GradAccSFTTrainer, on the same model,
data and arguments (CPU; one process per run, so no run sees another's allocations).

    python benchmarks/trl_sft_memory.py                      # 32k vocabulary, batch 4 x GA 4, 6 steps, 2 runs each
    python benchmarks/trl_sft_memory.py --json sft_memory.json

What is measured, per optimizer step: the rise of the process's resident-set high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs`` at the end of the previous step, so the step's fetch, forward, backward and
optimizer step are all inside) over the resident set at that reset; glibc's mmap threshold is fixed at 32 KiB so that
freed tensors leave the resident set. The first step (it allocates AdamW's state) is reported apart. Also the whole
run's peak resident set (model, optimizer, data, Python): the largest ``VmHWM`` seen before each reset. The runs alternate between the trainers.

Model: a Llama causal LM with a 32000-token vocabulary (untied embeddings), hidden 128, 2 layers, fp32. Data:
prompt-completion rows of 16-128 prompt tokens and 8-128 completion tokens (loss on the completions), random ids.
TRL's defaults otherwise (its fused LM head, AdamW), ``bf16=False``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from typing import Any

TRAINERS = ("SFTTrainer", "GradAccSFTTrainer")


# ---------------------------------------------------------------------------------------------- one run (a process)
class _Probe:
    """Rise of the resident-set high-water mark since :meth:`start` (Linux)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 * 1024)  # M_MMAP_THRESHOLD: large tensors are mmap'd and handed back on free
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
        self.baseline = 0

    @staticmethod
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise OSError(f"{key} not in /proc/self/status")

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.baseline = self.status("VmRSS")

    def peak(self) -> int:
        return self.status("VmHWM") - self.baseline


def _rows(opts: argparse.Namespace) -> list[dict[str, list[int]]]:
    rng = random.Random(opts.seed)
    rows = []
    for _ in range(opts.batch_size * opts.gradient_accumulation_steps * opts.steps):
        prompt, completion = rng.randint(16, 128), rng.randint(8, 128)
        ids = [rng.randint(3, opts.vocab_size - 1) for _ in range(prompt + completion)]
        rows.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * completion})
    return rows


def run_one(opts: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    from hf_gradacc.testing.trl_steps import word_tokenizer

    torch.set_num_threads(1)
    probe = _Probe()

    class PerStep(TrainerCallback):
        peaks: list[int] = []
        process_peak = 0  # the high-water mark is reset every step: keep the largest one seen

        def on_train_begin(self, args, state, control, **kwargs):
            self.process_peak = max(self.process_peak, _Probe.status("VmHWM"))
            probe.start()

        def on_step_end(self, args, state, control, **kwargs):
            self.peaks.append(probe.peak())
            self.process_peak = max(self.process_peak, _Probe.status("VmHWM"))
            probe.start()

    if opts.worker == "GradAccSFTTrainer":
        from hf_gradacc.trl import GradAccSFTConfig as Config
        from hf_gradacc.trl import GradAccSFTTrainer as Trainer
    else:
        from trl import SFTConfig as Config
        from trl import SFTTrainer as Trainer
    torch.manual_seed(opts.seed)
    config = LlamaConfig(
        vocab_size=opts.vocab_size, hidden_size=opts.hidden_size, intermediate_size=2 * opts.hidden_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    args = Config(
        output_dir=tempfile.mkdtemp(prefix="sft_memory_"), per_device_train_batch_size=opts.batch_size,
        gradient_accumulation_steps=opts.gradient_accumulation_steps, max_steps=opts.steps, learning_rate=1e-4,
        bf16=False, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        completion_only_loss=True, max_length=None, seed=opts.seed, dataloader_drop_last=False,
    )  # fmt: skip
    callback = PerStep()
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(_rows(opts)),
                      processing_class=word_tokenizer(opts.vocab_size), callbacks=[callback])  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "trainer": opts.worker,
        "step_peaks": callback.peaks,
        "process_hwm": callback.process_peak,
        "losses": [h["loss"] for h in logs],
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


# ---------------------------------------------------------------------------------------------- the comparison
def _versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers
    import trl

    import hf_gradacc

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "trl": trl.__version__, "hf_gradacc": hf_gradacc.__version__}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is reported apart)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per trainer, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the runs and the summary to this file")
    parser.add_argument("--worker", choices=TRAINERS, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker is not None:
        print("RESULT " + json.dumps(run_one(opts)), flush=True)
        return {}

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    keys = ("vocab_size", "hidden_size", "batch_size", "gradient_accumulation_steps", "steps", "seed")
    forwarded = [item for key in keys for item in (f"--{key}", str(getattr(opts, key)))]
    runs: list[dict[str, Any]] = []
    for repeat in range(opts.repeats):
        order = TRAINERS if repeat % 2 == 0 else TRAINERS[::-1]
        for name in order:
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", name],
                env=env, capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{name} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            runs.append(json.loads(lines[-1][len("RESULT ") :]))
            print(f"run {len(runs)}: {name}: step peaks (MiB) "
                  f"{[round(p / 2**20, 1) for p in runs[-1]['step_peaks']]}", flush=True)  # fmt: skip

    summary: dict[str, Any] = {}
    for name in TRAINERS:
        mine = [r for r in runs if r["trainer"] == name]
        timed = [p for r in mine for p in r["step_peaks"][1:]]
        summary[name] = {
            "first_step_peak_mib": max(r["step_peaks"][0] for r in mine) / 2**20,
            "step_peak_median_mib": statistics.median(timed) / 2**20,
            "step_peak_max_mib": max(timed) / 2**20,
            "process_peak_rss_mib": max(r["process_hwm"] for r in mine) / 2**20,
            "final_loss": mine[0]["losses"][-1],
        }
    ours, stock = summary["GradAccSFTTrainer"], summary["SFTTrainer"]
    ratios = {key: ours[key] / stock[key] for key in ours if key.endswith("_mib")}
    result = {"settings": {k: v for k, v in vars(opts).items() if k not in ("json", "worker")},
              "num_parameters": runs[0]["num_parameters"], "versions": _versions(), "runs": runs,
              "summary": summary, "ratio_gradacc_over_stock": ratios}  # fmt: skip
    print(f"\n{'':<22}{'first step':>12}{'step median':>13}{'step max':>10}{'process peak':>14}   (MiB)")
    for name in TRAINERS:
        s = summary[name]
        print(f"{name:<22}{s['first_step_peak_mib']:>12.1f}{s['step_peak_median_mib']:>13.1f}"
              f"{s['step_peak_max_mib']:>10.1f}{s['process_peak_rss_mib']:>14.1f}")  # fmt: skip
    print(f"{'ratio (GradAcc/stock)':<22}{ratios['first_step_peak_mib']:>12.3f}{ratios['step_peak_median_mib']:>13.3f}"
          f"{ratios['step_peak_max_mib']:>10.3f}{ratios['process_peak_rss_mib']:>14.3f}")  # fmt: skip
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
