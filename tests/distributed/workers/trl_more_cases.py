"""Worker of ``tests/distributed/test_trl_more.py``: TRL's KTO, RLOO and Distillation trainers, hf_gradacc's and
stock, ONE SGD(lr=1) step on 2 CPU ranks (gloo, DDP), each against the float64 full batch over both ranks' samples
(:func:`hf_gradacc.commands.check.trl_more_rows.more_one_step`, what ``hf-gradacc check --trainer`` runs). Each
case writes both trainers' comparisons and the step's samples.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from tests.distributed.workers._common import run_named_cases


def run_case(kind: str) -> dict[str, Any]:
    from hf_gradacc.commands.check.trl_more_rows import MORE_TRL_NAMES, more_one_step
    from hf_gradacc.testing.tiny import build_tiny_model

    step_kwargs = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, seed=0, optim="sgd",
                       use_cpu=True, ddp_backend="gloo", ddp_timeout=120)  # fmt: skip
    step = more_one_step(kind, build_tiny_model("causal_lm", seed=0), step_kwargs, world_size=2)
    name = MORE_TRL_NAMES[kind]
    ours, stock = step.results[f"GradAcc{name}Trainer"], step.results[f"{name}Trainer"]
    return {
        "num_processes": step.trainer.accelerator.num_processes,
        "distributed_type": str(step.trainer.accelerator.distributed_type),
        "num_samples": step.num_samples,
        "relative_error": ours.relative_error,
        "stock_relative_error": stock.relative_error,
        "data_note": step.data_note,
    }


CASES = {kind: partial(run_case, kind) for kind in ("kto", "rloo", "distillation")}

if __name__ == "__main__":
    run_named_cases(CASES, __doc__)
