"""The collective budget (issue 24, item 9), shared by the mesh tests: what the library may add to an optimizer step on
any mesh, read from the counts of ``tests/distributed/workers/mesh_cases.Budget`` (every ``torch.distributed`` and
functional collective, keyed ``<function>@<who asked>``; a collective inside a module call is ``@model<...``, the
model's forward whoever ran it) against the stock Trainer's step on the same mesh.

The library's own collectives in a step: the count all-gather on the data group (``COUNT``, where the stock Trainer
gathers its ``num_items_in_batch``; none when the data group is one rank), the non-finite flag (``FLAG``), one
all-reduce for every DTensor gradient's norm on the tensor-parallel backend (``NORM``, where the stock Trainer reduces
its own norm), and once per run, in the first step, the start-up loss check (``ONE_OFF``). Per log line: at most one
(``LOG``: the loss terms and a mixture-of-experts model's expert load in one gather).
"""

from __future__ import annotations

ONE_OFF = "all_gather@hf_gradacc:all_gather<agree<train_window"  # the first window's loss check, once per run
COUNT = "all_gather@hf_gradacc:all_gather<gather_window_counts<prefetched"
FLAG = "all_reduce@hf_gradacc:sum_over_processes<agreed_flags<step_verdict"
NORM = "all_reduce@hf_gradacc:grad_sq_norms<clip_grad_norm<optimizer_step"
LOG = "all_gather@hf_gradacc:all_gather<pop_means<pop"  # loss/<term> and moe/load_max_over_mean, one gather
# (not checked: once per epoch, at its end, ``all_gather<_run_epoch<train``, the loss since the last log line as the
# mean over the data ranks, which the Trainer adds to the run's train_loss)


def library(counted: dict) -> dict[str, int]:
    """The collectives the library asked for, of one step's or one log line's counts."""
    return {key: n for key, n in counted["calls"].items() if "@hf_gradacc" in key}


def train_log(run: dict) -> dict:
    """The run's one training log line (``logging_steps`` 1, one step)."""
    [line] = [line for line in run["logs"] if line["is_train_log"]]
    return line


def assert_within_budget(ours: dict, stock: dict, *, expected: dict[str, int], first: bool, by_design: int = 0) -> int:
    """One optimizer step of ours against the stock Trainer's on the same mesh: the library's collectives are exactly
    ``expected`` (plus ``ONE_OFF`` in the ``first`` step), and ours adds at most 2 (the flag, and the count where stock
    gathers none) beyond the stock step's total, less ``by_design`` (collectives a chosen ``fsdp_sync`` adds on
    purpose). Returns ours minus stock (without the one-off and ``by_design``)."""
    assert library(ours) == expected | ({ONE_OFF: 1} if first else {}), (ours, stock)
    extra = ours["total"] - first - by_design - stock["total"]
    assert extra <= 2, (extra, ours, stock)
    return extra
