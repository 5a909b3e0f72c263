"""CPU benchmark: the stock Trainer (random, group_by_length, batch_rebalance, flattening) against GradAccTrainer
(plain, regrouped, token budget, packed), in one run (docs/benchmarks.md, the current record).

    python benchmarks/bench_cpu.py                       # every default trainer, equal, long-tailed, completion-only
    python benchmarks/bench_cpu.py --steps 2 --json out.json
    python benchmarks/bench_cpu.py --vocab-size 32000 --datasets long_tailed --steps 4 --json run1.json
    python benchmarks/bench_cpu.py --vocab-size 151936 --datasets completion_only,long_tailed --batch-size 4 \
        --grad-accum 2 --max-length 512 --max-tokens 1024 --steps 3 --json qwen.json

Scale: the issue's bs 8 x GA 8 and long-tailed lengths (log-normal, median 100, max 1024) on a tiny Llama
(hidden 64, 2 layers) with one torch thread. Equal lengths: 100 tokens; completion-only: the long-tailed lengths with
the first half of every sample masked (-100). At Qwen's vocabulary (151,936) bs 8 x GA 8 would take 4.75x the
stock step of vocabulary 32,000 (~14 GB, ~75-100 s of CPU per step: scaled from 2.9 GB and 16-21 s), too much for a shared
2-core machine; the last command is the smallest shape that carries that vocabulary (docs/benchmarks.md).
Every flag of ``hf-gradacc bench`` works here; this script only sets the CPU defaults and pins the BLAS threads
before torch starts.
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
