"""GPU benchmark: the same comparison as ``bench_cpu.py`` on CUDA, with a larger Llama in bf16 autocast.

    python benchmarks/gpu.py                              # one GPU
    torchrun --nproc_per_node 2 benchmarks/gpu.py         # DDP: also counts gradient reductions per step
    python benchmarks/gpu.py --cpu-fallback               # the same code path on CPU, tiny and quick (tests)

Model: hidden 1024, 8 layers, 16 heads, vocabulary 32000 (about 0.1 B parameters); bs 8 x GA 8; equal lengths
(100 tokens) and long-tailed ones (log-normal, median 100, max 1024). Peak memory is ``max_memory_allocated``
within each step. Without a CUDA device (and without ``--cpu-fallback``) it stops with exit code 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

GPU_DEFAULTS = [
    "--device", "cuda", "--bf16", "--hidden-size", "1024", "--num-layers", "8", "--num-heads", "16",
    "--vocab-size", "32000", "--steps", "10", "--warmup-steps", "2", "--max-tokens", "4096",
]
CPU_FALLBACK = [
    "--device", "cpu", "--threads", "1", "--hidden-size", "32", "--num-layers", "1", "--vocab-size", "96",
    "--batch-size", "2", "--grad-accum", "2", "--steps", "1", "--warmup-steps", "1", "--max-length", "64",
    "--median-length", "16", "--equal-length", "16", "--max-tokens", "64",
]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--cpu-fallback", action="store_true")
    known, rest = pre.parse_known_args(argv)
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
    return bench_main([*GPU_DEFAULTS, *rest])


if __name__ == "__main__":
    raise SystemExit(main())
