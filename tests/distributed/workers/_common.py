"""Helpers shared by the worker scripts: rank info, JSON results for the launcher to read back, and the recorders
the cases use (warnings, and the collectives each backend runs)."""

from __future__ import annotations

import functools
import json
import logging
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


def pack_rows_always() -> None:
    """`pack_micro_batches` lays every micro-batch out as ONE packed row, as on a device with a variable-length
    attention kernel (flash / flex on a GPU): these workers test the packed rows under each backend. On this CPU
    (sdpa, dense attention) the trainer's cost model would pad the micro-batches that cost less padded; that choice
    is tested on one process (tests/unit/test_pack.py, test_packing.py)."""
    from hf_gradacc.data.attention_cost import AttentionCostModel

    AttentionCostModel.for_model = classmethod(lambda cls, model, padded_layout=True: None)  # type: ignore[method-assign]


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
    from hf_gradacc.backends.distributed import finish_distributed

    finish_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# ---------------------------------------------------------------------------------------------- recorders
class WarningRecorder(logging.Handler):
    """Records the warnings of the ``hf_gradacc`` loggers while it is entered (or added as a handler)."""

    def __init__(self, logger_name: str = "hf_gradacc") -> None:
        super().__init__(level=logging.WARNING)
        self.logger_name = logger_name
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> WarningRecorder:
        logging.getLogger(self.logger_name).addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger(self.logger_name).removeHandler(self)


@functools.cache
def _ddp_comm_hook_counter_class() -> type:
    from transformers import TrainerCallback

    class DDPCommHookCounter(TrainerCallback):
        """A `TrainerCallback` recorder of every bucket all-reduce of the DDP reducer: a comm hook on the
        wrapped model notes the optimizer step, the running micro-batch (``trainer.current_window.index``), the
        bucket and its size. Add it to the trainer's callbacks and ``bind`` it to the trainer."""

        def __init__(self) -> None:
            self.trainer: Any = None
            self.calls: list[dict[str, Any]] = []
            self.registered_on: str | None = None

        def bind(self, trainer: Any) -> None:
            self.trainer = trainer

        def on_train_begin(self, args, state, control, **kwargs):
            wrapped = self.trainer.model_wrapped  # kwargs["model"] is the unwrapped model: no comm hooks there
            self.registered_on = type(wrapped).__name__
            wrapped.register_comm_hook(self, _counting_allreduce_hook)

    return DDPCommHookCounter


def __getattr__(name: str) -> Any:
    # transformers (and torch under it) is imported only by the workers that use it: the launcher probe, which
    # imports this module, must start within its timeout test's 8 s also on a busy 2-core machine (9.6 s with it)
    if name == "DDPCommHookCounter":
        return _ddp_comm_hook_counter_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _counting_allreduce_hook(counter, bucket):  # no annotations: DDP checks them, and they are strings here
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    window = counter.trainer.current_window
    counter.calls.append(
        {
            "step": counter.trainer.state.global_step,
            "micro_batch": None if window is None else window.index,
            "bucket": bucket.index(),
            "numel": bucket.buffer().numel(),
        }
    )
    return default_hooks.allreduce_hook(None, bucket)


class ZeroReductionCounter:
    """Counts the DeepSpeed ZeRO optimizer's gradient reduction calls (``calls``).

    ZeRO-1/2 reduce a bucket in ``average_tensor`` (or ``buffered_reduce_fallback`` without contiguous
    gradients); ZeRO-3 in ``__avg_scatter_grads`` / ``__avg_scatter_contiguous_grads``. The wrappers are instance
    attributes, so DeepSpeed's own ``self.<method>(...)`` calls go through them.
    """

    METHODS = (
        "average_tensor",
        "buffered_reduce_fallback",
        "_buffered_reduce_fallback_preserving_fp32",
        "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
        "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads",
    )

    def __init__(self) -> None:
        self.calls = 0
        self.wrapped: list[str] = []

    def install(self, zero_optimizer: Any) -> None:
        import torch

        for method in self.METHODS:
            original = getattr(zero_optimizer, method, None)
            if original is None:
                continue

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                tensor = args[0] if args else None
                if not (torch.is_tensor(tensor) and tensor.numel() == 0):  # an empty bucket is no reduction
                    self.calls += 1
                return _original(*args, **kwargs)

            setattr(zero_optimizer, method, counted)
            self.wrapped.append(method)


class CollectiveCounter:
    """Counts the ``torch.distributed`` reduce-scatter and all-reduce calls made while it is entered (FSDP2 looks
    these functions up per call)."""

    # The first name torch has: FSDP2 calls ``reduce_scatter_single`` where it exists, ``reduce_scatter_tensor`` before
    # (torch 2.6 has only the latter).
    FUNCTIONS = (
        ("reduce_scatter", ("reduce_scatter_single", "reduce_scatter_tensor")),
        ("all_reduce", ("all_reduce",)),
    )

    def __init__(self) -> None:
        self.counts = {key: 0 for key, _ in self.FUNCTIONS}
        self._originals: dict[str, Any] = {}

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed as dist

        for key, names in self.FUNCTIONS:
            fn_name = next(name for name in names if hasattr(dist, name))
            original = getattr(dist, fn_name)
            self._originals[fn_name] = original

            def wrapped(*args: Any, _key: str = key, _original: Any = original, **kwargs: Any) -> Any:
                self.counts[_key] += 1
                return _original(*args, **kwargs)

            setattr(dist, fn_name, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        for fn_name, original in self._originals.items():
            setattr(dist, fn_name, original)


def run_named_cases(cases: dict[str, Any], description: str | None) -> NoReturn:
    """``--cases a,b,...`` (default: all of ``cases``), each run in order on this rank and its payload written with
    :func:`write_result`; a failing case writes its traceback and ends the rank at once (no rank waits in a collective
    for one that will never join it)."""
    import argparse
    import traceback

    import torch

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cases", default=",".join(cases), help=f"comma-separated, from {sorted(cases)}")
    names = [n for n in parser.parse_args().cases.split(",") if n]
    unknown = sorted(set(names) - set(cases))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {sorted(cases)}")
    torch.set_num_threads(1)
    for name in names:
        try:
            payload = cases[name]()
        except BaseException:
            write_result(name, {"error": traceback.format_exc()})
            print(f"[rank {rank()}] case {name} failed", file=sys.stderr, flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        write_result(name, payload)
        print(f"[rank {rank()}] case {name} done", flush=True)
    finish_worker()
