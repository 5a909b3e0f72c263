"""Worker of ``tests/distributed/test_resume_layout.py``'s node-local cases: 2 ranks that do NOT share a disk, as on
several nodes without a shared file system. Each rank is the only process of its "node" (``LOCAL_RANK=0``) and has
its own ``output_dir`` (``<out>/rank<r>``), so each rank saves and reads only its own folder.

    python node_local_cases.py --case agree --out DIR     # started by tests/distributed/launcher.run_workers

Cases (one JSON result per rank, named after the case):

* ``agree``: run A saves checkpoints 1-3 into one folder; each rank's disk gets a copy of them (checkpoints staged
  onto node-local scratch). Then rank 1's disk differs from rank 0's: its checkpoint-3 lost its completion marker
  (``hf_gradacc_saving`` left: node 1 died before writing it), and its checkpoint-2's data record says 8 samples were
  trained, not 16 (another run's record). Run B, ``resume_from_checkpoint=True`` in the same layout with each rank's
  own ``output_dir``, must resume checkpoint-2 on BOTH ranks (agreed: rank 0 alone would take its complete
  checkpoint-3) at rank 0's position (rank 0's record on every rank: rank 1's own would resume at sample 8): B's steps
  and weights are A's, bit for bit.
* ``save_on_each_node``: each rank saves into its own disk with ``save_on_each_node=True`` (each node's local main
  process saves): rank 1's folder gets the optimizer, scheduler and trainer state, but not the model weights
  (transformers' ``save_pretrained`` writes on global rank 0 only). ``resume_from_checkpoint=True`` is the same clear
  error on both ranks, saying what to copy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

os.environ["LOCAL_RANK"] = "0"  # each rank is the only process of its node (set before accelerate reads it)

import torch.distributed as dist  # noqa: E402

from hf_gradacc.checkpoints import COMPLETE_NAME, DATA_NAME, POSITION_KEY, SAVING_NAME, _write_marker  # noqa: E402
from tests.distributed.workers._common import finish_worker, rank, write_result  # noqa: E402
from tests.distributed.workers.resume_layout_cases import train_run  # noqa: E402

LAYOUT = dict(batch=2, ga=2, ddp_timeout=30)  # 24 samples, 8 per step on 2 ranks: 3 steps


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def case_agree(out: Path) -> dict[str, Any]:
    a = train_run(str(out / "shared"), **LAYOUT)
    dist.barrier()
    disk = out / f"rank{rank()}"
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        shutil.copytree(out / "shared" / name, disk / name)
    dist.barrier()
    if rank() == 1:
        newest = disk / "checkpoint-3"
        (newest / COMPLETE_NAME).unlink()
        (newest / SAVING_NAME).write_text("")
        record_path = disk / "checkpoint-2" / DATA_NAME
        record = json.loads(record_path.read_text())
        record[POSITION_KEY]["num_samples"], record[POSITION_KEY]["num_micro_batches"] = 8, 2
        record_path.write_text(json.dumps(record))
        _write_marker(str(disk / "checkpoint-2"))
    dist.barrier()
    b = train_run(str(disk), resume=True, **LAYOUT)
    return {"a": a, "b": b}


def case_save_on_each_node(out: Path) -> dict[str, Any]:
    disk = out / f"rank{rank()}"
    train_run(str(disk), max_steps=1, save_on_each_node=True, **LAYOUT)
    files = _listing(disk / "checkpoint-1")
    dist.barrier()
    try:
        train_run(str(disk), max_steps=2, save_on_each_node=True, resume=True, **LAYOUT)
    except Exception as error:  # noqa: BLE001 - the outcome is the result
        return {"files": files, "error_type": type(error).__name__, "error": str(error)}
    return {"files": files, "error_type": None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, choices=("agree", "save_on_each_node"))
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    cases = {"agree": case_agree, "save_on_each_node": case_save_on_each_node}
    try:
        payload = cases[options.case](Path(options.out))
    except BaseException:
        write_result(options.case, {"error": traceback.format_exc()})
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # the other rank fails in its next collective instead of waiting forever
    write_result(options.case, payload)
    finish_worker()


if __name__ == "__main__":
    main()
