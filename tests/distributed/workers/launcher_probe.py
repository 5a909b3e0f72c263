"""Launcher self-test worker: reports its rank environment, then sleeps or fails as asked. Imports no torch."""

from __future__ import annotations

import argparse
import os
import sys
import time

from _common import rank, write_result

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PROBE_EXTRA")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after reporting")
    parser.add_argument("--fail-rank", type=int, default=-1, help="this rank exits with status 3")
    args = parser.parse_args()
    write_result("probe", {"pid": os.getpid(), "env": {k: os.environ.get(k) for k in ENV_KEYS}})
    print(f"hello from rank {rank()}", flush=True)
    print(f"stderr of rank {rank()}", file=sys.stderr, flush=True)
    if rank() == args.fail_rank:
        sys.exit(3)
    time.sleep(args.sleep)


if __name__ == "__main__":
    main()
