"""Helpers shared by the worker scripts: rank info and JSON results for the launcher to read back."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

OUT_DIR_ENV = "HF_GRADACC_TEST_OUT"  # the launcher (tests/distributed/launcher.py) sets it


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def out_dir() -> Path:
    path = os.environ.get(OUT_DIR_ENV)
    if not path:
        raise RuntimeError(f"{OUT_DIR_ENV} is not set: start the worker with tests/distributed/launcher.run_workers")
    return Path(path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN / inf; keep them visible to the test as strings
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # tensors and numpy scalars
        return _jsonable(value.item())
    return value


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write this rank's result ``name`` as ``<out>/<name>.rank<r>.json`` (atomically)."""
    path = out_dir() / f"{name}.rank{rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_jsonable(payload), indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def finish_worker(status: int = 0) -> NoReturn:
    """End a worker: wait for every rank, destroy the process group, flush, and exit with ``status`` at once.

    Leaving through ``os._exit`` skips interpreter finalisation: on gloo ranks a worker thread may still hold the
    last collective's tensors, and freeing them while the interpreter shuts down aborts the rank (SIGABRT) now
    and then on a loaded machine, after every result was written. ``finish_distributed``'s short sleep makes that
    rare; skipping finalisation makes it impossible. Every result file is written before this is called.
    """
    from hf_gradacc.backends import finish_distributed

    finish_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
