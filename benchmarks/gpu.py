"""GPU benchmarks: the GPU tier (``--tier``), or the same comparison as ``bench_cpu.py`` on CUDA (the bench rows).

    python benchmarks/gpu.py --tier --out tier/           # the GPU tier: one command, ~7 min on one H100 / H200
    python benchmarks/gpu.py --tier --cpu-fallback --out tier/   # the tier's code on CPU at a tiny scale (CI)
    python benchmarks/gpu.py                              # the bench rows, one GPU
    torchrun --nproc_per_node 2 benchmarks/gpu.py         # DDP: also counts gradient reductions per step
    python benchmarks/gpu.py --cpu-fallback               # the bench rows' code path on CPU, tiny and quick (tests)

``--tier`` hands every argument to ``benchmarks/gpu_tier.py`` (its docstring: the four sections, bf16 exactness per
head, device reads per step, step time against the stock Trainer at GA 1/4/8 on a ~0.5B Llama, the fused LM head
against torch / Liger / Cut Cross-Entropy; their budgets; ``gpu_tier.json`` and ``gpu_tier.md`` under ``--out``).
Without ``--tier``, the bench rows.

The bench rows' model: hidden 1024, 8 layers, 16 heads, vocabularies 32000 and 151,936 (Qwen's); bs 8 x GA 8; equal lengths (100
tokens), long-tailed ones (log-normal, median 100, max 1024) and completion-only ones (long-tailed, the first half of
every sample ignored). Rows: the stock Trainer's (random, group_by_length, batch_rebalance, flattening), the
GradAccTrainer's (plain, regrouped, token budget, packed), the fused LM head (alone, with the token budget, packed)
and, where the ``liger-kernel`` package is installed, the stock Trainer with Liger's kernels (its fused linear
cross-entropy). Peak memory is ``max_memory_allocated`` within each step. Without a CUDA device (and without
``--cpu-fallback``) it stops with exit code 2. ``--trainers`` / ``--vocab-sizes`` / ``--datasets`` replace the
defaults.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

GPU_DEFAULTS = [
    "--device", "cuda", "--bf16", "--hidden-size", "1024", "--num-layers", "8", "--num-heads", "16",
    "--vocab-sizes", "32000,qwen", "--datasets", "equal,long_tailed,completion_only", "--steps", "10",
    "--warmup-steps", "2", "--max-tokens", "4096",
]  # fmt: skip
GPU_TRAINERS = (
    "stock", "stock_group_by_length", "stock_batch_rebalance", "stock_flatten", "plain", "regroup", "budget", "pack",
    "fused", "budget_fused", "pack_fused",
)  # fmt: skip


def gpu_trainers() -> tuple[str, ...]:
    """The rows this script runs: every bench row with the fused LM head's, and Liger's where it is installed."""
    if importlib.util.find_spec("liger_kernel") is None:
        print("benchmarks/gpu.py: liger-kernel is not installed; the `stock_liger` row is left out.", file=sys.stderr)
        return GPU_TRAINERS
    return (*GPU_TRAINERS, "stock_liger")
CPU_FALLBACK = [
    "--device", "cpu", "--threads", "1", "--hidden-size", "32", "--num-layers", "1", "--vocab-size", "96",
    "--batch-size", "2", "--grad-accum", "2", "--steps", "1", "--warmup-steps", "1", "--max-length", "64",
    "--median-length", "16", "--equal-length", "16", "--max-tokens", "64",
]


def tier_main(argv: list[str]) -> int:
    """``benchmarks/gpu_tier.py``'s main (loaded from beside this file, so that it works however this one was)."""
    path = Path(__file__).resolve().with_name("gpu_tier.py")
    spec = importlib.util.spec_from_file_location("gpu_tier", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_tier", module)  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--cpu-fallback", action="store_true")
    pre.add_argument("--tier", action="store_true")
    known, rest = pre.parse_known_args(argv)
    if known.tier:
        return tier_main(argv)
    from hf_gradacc.commands.bench import main as bench_main

    if known.cpu_fallback:
        return bench_main([*CPU_FALLBACK, *rest])
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a CUDA device (torch.cuda.is_available() is False). Run benchmarks/bench_cpu.py "
            "on CPU, or pass --cpu-fallback to try this script's code path on CPU at a tiny scale.",
            file=sys.stderr,
        )
        return 2
    trainers = [] if any(a.startswith("--trainers") for a in rest) else ["--trainers", ",".join(gpu_trainers())]
    return bench_main([*GPU_DEFAULTS, *trainers, *rest])


if __name__ == "__main__":
    raise SystemExit(main())
