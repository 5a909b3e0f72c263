"""`hf-gradacc check --scenario moe_global`: one optimizer step of a tiny mixture-of-experts model three ways — the
stock Trainer, GradAccTrainer with ``router_balance="micro_batch"`` and with ``"global_batch"`` — each against the
float64 reference of definition B (the load-balancing loss formed once over every routed token of the step,
:mod:`hf_gradacc.testing.moe_reference`).

Example:
    ```python
    results, trainer, logs = moe_global_results(build_tiny_moe("mixtral"), samples, PaddingCollator(),
                                                dict(per_device_train_batch_size=2, gradient_accumulation_steps=4))
    results["GradAcc global"].relative_error   # ~4e-07
    ```
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

from ...testing.moe_reference import global_balance_gradients
from ...testing.one_step import one_step_args, one_step_update
from ...testing.reference import compare

GLOBAL_NAME, MICRO_NAME, STOCK_NAME = "GradAcc global", "GradAcc micro", "Trainer"


def moe_global_results(
    model: Any, samples: list, collator: Any, step_kwargs: dict[str, Any], *, verbose: bool = False
) -> tuple[dict[str, Any], Any, dict[str, float]]:
    """``({name: Comparison against B}, the global-batch trainer, {"router/<name>": the router weights' relative
    error}``: the rows global, micro-batch, stock, each one step on ``samples`` (every rank's) from the same initial
    ``model``. The router weights are a small share of the update, where the rules differ most."""
    from transformers import Trainer

    from ... import GradAccTrainer

    reference = global_balance_gradients(model, samples, collator)
    results: dict[str, Any] = {}
    ours, logs = None, {}
    router = [n for n in reference if n.endswith("gate.weight")]
    for name, trainer_class, balance in (
        (GLOBAL_NAME, GradAccTrainer, "global_batch"),
        (MICRO_NAME, GradAccTrainer, "micro_batch"),
        (STOCK_NAME, Trainer, None),
    ):
        extra = {"gradacc_args": {"router_balance": balance}} if balance else {}
        out = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
        with out:
            update, trainer = one_step_update(
                trainer_class,
                model,
                samples,
                one_step_args(**step_kwargs),
                data_collator=collator,
                trainer_kwargs=extra,
            )
        results[name] = compare(update, reference)
        logs[f"router/{name}"] = compare(
            {n: update[n] for n in router}, {n: reference[n] for n in router}
        ).relative_error
        ours = ours or trainer
    return results, ours, logs


def moe_global_note(results: dict[str, Any], logs: dict[str, float]) -> str:
    """Why the rows differ: the micro-batch rule and the stock Trainer form the balance loss per micro-batch."""
    micro, stock = results[MICRO_NAME], results[STOCK_NAME]
    routers = ", ".join(f"{name} {logs[f'router/{name}']:.2e}" for name in results if f"router/{name}" in logs)
    return (
        "Every row is compared with definition B: the router load-balancing loss formed ONCE over the expert "
        "fractions "
        "and router probabilities of every routed token of the step (router_balance='global_batch', docs/moe.md). "
        f"router_balance='micro_batch' (the default, the model's own per-forward rule weighted by routed tokens) is "
        f"{micro.relative_error:.2e} from it: a different loss, exact against its own definition (hf-gradacc check "
        f"--scenario moe_mixtral). The stock Trainer is {stock.relative_error:.2e} from it: per micro-batch and "
        f"divided by GA. The router weights alone (relative error against B): {routers}."
    )
