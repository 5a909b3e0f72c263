"""`hf-gradacc bench`'s mixture-of-experts rows: ``router_balance="global_batch"`` priced against ``"micro_batch"``.

``--trainers stock,moe_micro,moe_global`` trains, instead of the dense Llama, a tiny Mixtral (the bench's hidden size,
layers, heads and vocabulary; 4 experts, top-2, ``router_aux_loss_coef`` 0.02, router logits returned) for EVERY row
of the run, the stock one included: ``moe_micro`` is GradAccTrainer with ``router_balance="micro_batch"`` (the
default: the model's balance loss per micro-batch), ``moe_global`` the same with ``"global_batch"`` (one routing
pre-pass per micro-batch, the balance loss formed once over the step, docs/moe.md). Besides the table against the
stock Trainer, :func:`format_moe_comparison` prints ``moe_global`` against ``moe_micro`` directly: the median of the
step-by-step CPU time ratios (steps run in turns, so step ``s`` of both ran within seconds), the total CPU time ratio
and the ratio of the peak memory within a step.

Example:
    ```bash
    hf-gradacc bench --quick --repeats 1 --trainers stock,moe_micro,moe_global
    ```
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

MOE_TRAINERS: tuple[str, ...] = ("moe_micro", "moe_global")
MOE_LABELS: dict[str, str] = {
    "moe_micro": "GradAccTrainer + MoE router_balance=micro_batch",
    "moe_global": "GradAccTrainer + MoE router_balance=global_batch",
}
NUM_EXPERTS = 4
ROUTER_AUX_LOSS_COEF = 0.02


def uses_moe(trainers: Sequence[str]) -> bool:
    """Whether a run names a mixture-of-experts row (then every row of it trains the MoE model)."""
    return any(name in MOE_TRAINERS for name in trainers)


def moe_trainer_kwargs(name: str) -> dict[str, Any]:
    """The GradAccConfig fields of the MoE row ``name``."""
    return {"router_balance": {"moe_micro": "micro_batch", "moe_global": "global_batch"}[name]}


def build_bench_moe_model(dims: dict[str, Any]) -> torch.nn.Module:
    """A randomly initialised Mixtral causal LM of the bench's size (``dims``: the config fields the bench's Llama
    takes; the caller seeds torch): 4 experts, top-2, its own balance loss (coefficient 0.02) in its loss, dropout
    off."""
    import transformers as tf

    config = tf.MixtralConfig(
        **dims,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        router_aux_loss_coef=ROUTER_AUX_LOSS_COEF,
        output_router_logits=True,
    )
    return tf.MixtralForCausalLM(config)


def moe_ratios(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """Per (dataset, vocabulary) with both MoE rows: ``moe_global`` over ``moe_micro`` (BenchRows): ``cpu_time_ratio``
    (median over the timed steps of the pair ratios; ``cpu_time_ratio_range`` their min and max),
    ``total_cpu_time_ratio``, ``step_time_ratio`` (median of the wall-time pair ratios; ``step_time_ratio_range``) and
    ``peak_memory_ratio`` (peak within a step, every step)."""
    out = []
    for group in sorted({(r.dataset, r.vocab_size) for r in rows}):
        pick = {r.trainer: r for r in rows if (r.dataset, r.vocab_size) == group}
        if not all(name in pick for name in MOE_TRAINERS):
            continue
        micro, glob = pick["moe_micro"], pick["moe_global"]
        cpu = [g / m for g, m in zip(glob.step_cpu_times_s, micro.step_cpu_times_s) if m > 0]
        wall = [g / m for g, m in zip(glob.step_times_s, micro.step_times_s) if m > 0]
        total = sum(micro.step_cpu_times_s)
        out.append(
            {
                "dataset": group[0],
                "vocab_size": group[1],
                "cpu_time_ratio": statistics.median(cpu) if cpu else float("nan"),
                "cpu_time_ratio_range": (min(cpu), max(cpu)) if cpu else (float("nan"),) * 2,
                "total_cpu_time_ratio": sum(glob.step_cpu_times_s) / total if total > 0 else float("nan"),
                "step_time_ratio": statistics.median(wall) if wall else float("nan"),
                "step_time_ratio_range": (min(wall), max(wall)) if wall else (float("nan"),) * 2,
                "peak_memory_ratio": glob.peak_memory_bytes / micro.peak_memory_bytes
                if micro.peak_memory_bytes > 0
                else float("nan"),
            }
        )
    return out


def format_moe_comparison(rows: Sequence[Any]) -> str:
    """The ``moe_global`` over ``moe_micro`` table (empty when a run lacks either row).

    Example:
        ```python
        print(format_moe_comparison(run_benchmark(BenchSettings(trainers=("stock", "moe_micro", "moe_global")))))
        ```
    """
    ratios = moe_ratios(rows)
    if not ratios:
        return ""
    lines = [
        "router_balance global_batch (moe_global) against micro_batch (moe_micro), same MoE model and samples:",
        "",
        "| data | vocab | CPU time ratio (median [min-max] of pairs) | total CPU time ratio | step time ratio (median "
        "[min-max] of pairs) | peak memory ratio |",
        "|" + " --- |" * 6,
    ]
    for r in ratios:
        cpu_low, cpu_high = r["cpu_time_ratio_range"]
        wall_low, wall_high = r["step_time_ratio_range"]
        lines.append(
            f"| {r['dataset']} | {r['vocab_size']} | {r['cpu_time_ratio']:.3f} [{cpu_low:.3f}-{cpu_high:.3f}] | "
            f"{r['total_cpu_time_ratio']:.3f} | {r['step_time_ratio']:.3f} [{wall_low:.3f}-{wall_high:.3f}] | "
            f"{r['peak_memory_ratio']:.3f} |"
        )
    return "\n".join(lines)
