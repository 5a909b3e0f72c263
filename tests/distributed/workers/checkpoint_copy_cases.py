"""Worker of ``tests/distributed/test_checkpoint_copies.py``: 2 ranks whose callbacks copy each checkpoint in
``on_save``, as Ray Train's ``RayTrainReportCallback`` does on every worker, and resume from their own copies.

    python checkpoint_copy_cases.py --out DIR     # started by tests/distributed/launcher.run_workers

One launch, one JSON result per rank (``copies``), three runs:

* ``a``: a run saving every step (3 steps) into one ``output_dir``; on every rank the callback copies the newest
  checkpoint (``get_last_checkpoint``, as Ray's callback picks it) into a folder of the rank's own
  (``<out>/copies/rank<r>/step<N>/checkpoint``, as Ray's callback copies into a temporary folder) and records what
  the copy holds. Rank 0's marker finish is delayed (:data:`DELAY_S` before ``_write_marker``), so a rank that ran
  ``on_save`` before rank 0 finished the checkpoint would copy it without ``hf_gradacc_complete.json`` (and with
  ``hf_gradacc_saving``), every time.
* ``b``: each rank resumes from ITS copy of checkpoint 1 (two different paths, the same checkpoint); it must end
  where ``a`` ends.
* ``mixed``: rank 0 resumes from its copy of checkpoint 1, rank 1 from its copy of checkpoint 2: refused on both
  ranks, naming both; the error is the result.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

import hf_gradacc.checkpoints as ckpt
from hf_gradacc.checkpoints import COMPLETE_NAME, SAVING_NAME
from tests.distributed.workers._common import finish_worker, rank, write_result
from tests.distributed.workers.resume_layout_cases import train_run

LAYOUT = dict(batch=2, ga=2, ddp_timeout=60)  # 24 samples, 8 per step on 2 ranks: 3 steps
DELAY_S = 1.5  # rank 0 waits this long before writing the completion marker


class CopyOnSave(TrainerCallback):
    """``on_save`` on every rank: copy the newest checkpoint into this rank's own folder (``shutil.copytree``, as
    ``RayTrainReportCallback`` does) and record what the copy holds, or the copy's error."""

    def __init__(self, copies: Path) -> None:
        self.copies, self.seen = copies, []

    def on_save(self, args, state, control, **kwargs):
        source = get_last_checkpoint(args.output_dir)
        target = self.copies / f"rank{rank()}" / f"step{state.global_step}" / "checkpoint"
        seen: dict[str, Any] = {"step": state.global_step, "source": os.path.basename(source or "")}
        try:
            shutil.copytree(source, target)
        except (shutil.Error, OSError) as error:
            seen["error"] = f"{type(error).__name__}: {error}"[:500]
        seen["complete"] = (target / COMPLETE_NAME).is_file()
        seen["saving"] = (target / SAVING_NAME).is_file()
        self.seen.append(seen)


def delay_rank_0_marker() -> None:
    """Rank 0 finishes each checkpoint :data:`DELAY_S` late: the race with the other ranks' ``on_save``, made certain."""
    if rank() != 0:
        return
    write_marker = ckpt._write_marker

    def late(folder: str) -> None:
        time.sleep(DELAY_S)
        write_marker(folder)

    ckpt._write_marker = late


def _outcome(run) -> dict[str, Any]:
    try:
        return run()
    except Exception as error:  # noqa: BLE001 - the outcome is the result
        return {"error_type": type(error).__name__, "error": str(error)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    try:
        delay_rank_0_marker()
        copier = CopyOnSave(out / "copies")
        a = train_run(str(out / "a"), callbacks=(copier,), **LAYOUT)
        own = out / "copies" / f"rank{rank()}"
        b = _outcome(lambda: train_run(str(out / "b"), resume=str(own / "step1" / "checkpoint"), **LAYOUT))
        step = 1 if rank() == 0 else 2
        mixed = _outcome(
            lambda: train_run(str(out / "mixed"), resume=str(own / f"step{step}" / "checkpoint"), **LAYOUT)
        )
        payload = {"a": a, "copies": copier.seen, "b": b, "mixed": mixed}
    except BaseException:
        write_result("copies", {"error": traceback.format_exc()})
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # the other rank fails in its next collective instead of waiting forever
    write_result("copies", payload)
    finish_worker()


if __name__ == "__main__":
    main()
