"""The line saying hf_gradacc is active, on 2 DDP CPU ranks (gloo), from a user script written as transformers'
run_clm.py is (``workers/run_clm_style.py``: its logging set-up, `HfArgumentParser`, `GradAccTrainer` swapped in):
``--log_level info --log_level_replica warning`` prints it once, on rank 0, where the Trainer prints its
``***** Running training *****`` banner, and not on rank 1, where the Trainer prints no banner."""

from __future__ import annotations

from pathlib import Path

import pytest

from .launcher import run_workers

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parent / "workers" / "run_clm_style.py"
BANNER = "***** Running training *****"
ACTIVE = "hf_gradacc: exact gradient accumulation"


def test_the_active_line_follows_log_level_and_log_level_replica(tmp_path: Path) -> None:
    flags = ["--output_dir", str(tmp_path), "--max_steps", "1", "--per_device_train_batch_size", "2",
             "--gradient_accumulation_steps", "4", "--report_to", "none", "--use_cpu", "--ddp_backend", "gloo",
             "--disable_tqdm", "true", "--save_strategy", "no", "--log_level", "info",
             "--log_level_replica", "warning"]  # fmt: skip
    launch = run_workers(WORKER, nproc=2, args=flags, timeout=420, out_dir=tmp_path / "out", env={"CI": ""})
    main, replica = (r.stdout + r.stderr for r in launch.ranks)
    assert main.count(BANNER) == 1 and main.count(ACTIVE) == 1, launch.describe()
    assert f"{ACTIVE}, MULTI_CPU, 2 processes, gloo, causal_lm, GA 4 x 2 ranks, count by tokens" in main, main
    assert replica.count(BANNER) == 0 and replica.count(ACTIVE) == 0, launch.describe()
