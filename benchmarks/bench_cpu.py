"""CPU benchmark: the stock Trainer (random, group_by_length, batch_rebalance, flattening) against GradAccTrainer
(plain, regrouped, token budget, packed), in one run (docs/benchmarks.md, the current record).

    python benchmarks/bench_cpu.py                       # every default trainer, equal and long-tailed data
    python benchmarks/bench_cpu.py --steps 2 --json out.json

Scale: the issue's bs 8 x GA 8 and long-tailed lengths (log-normal, median 100, max 1024) on a tiny Llama
(hidden 64, 2 layers) with one torch thread. Equal lengths: 100 tokens. Every flag of ``hf-gradacc bench`` works
here; this script only sets the CPU defaults and pins the BLAS threads before torch starts.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from hf_gradacc.commands.bench import main  # noqa: E402

CPU_DEFAULTS = ["--device", "cpu", "--threads", "1", "--steps", "8", "--warmup-steps", "1"]

if __name__ == "__main__":
    raise SystemExit(main([*CPU_DEFAULTS, *sys.argv[1:]]))
