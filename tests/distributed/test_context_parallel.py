"""Context parallelism (accelerate ``cp_size`` 2 x FSDP2) on 2 CPU ranks (gloo), one launch.

What runs is upstream's, end to end: accelerate's ``parallelism_config`` mesh (FSDP2 over ``dp_shard_cp``), its
``_prepare_cp`` and attention-mask hooks, the Trainer's context-parallel entry, torch's ``context_parallel`` cutting
the buffers with its head-tail load balancer, the dataloader dealing one batch to both cp ranks. Only the attention
kernel is a stand-in (tests/distributed/workers/cpu_context_parallel.py: an exact all-gather attention by global
position; torch 2.13 has no CPU sharding rule for SDPA), so the numbers here check the counting and the loss scale
on real collectives. On CUDA, with torch's own ring attention: tests/gpu/test_context_parallel.py.

Exact: relative gradient error <= 1e-5 against the float64 full batch (mixed lengths, heavy padding, masked prompts).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.launcher import run_workers

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().parent / "workers" / "context_parallel_cpu_cases.py"
TOLERANCE = 1e-5


def test_cp_2_on_cpu_ranks_is_the_full_batch_step():
    """GradAccTrainer: each cp rank counts its own chunks' targets (summed over both ranks in the step's one
    collective), the loss is scaled by the 2 ranks FSDP2 averages over: exact, every parameter moved. ``eval_loss``
    on both ranks (after the step) is the float64 one of the unsharded batches. A sequence classifier is refused at construction, by
    name; left-padded batches on one rank stop both ranks (agreed) in training and in evaluation; then `hf-gradacc check`
    on the same launch (:func:`check_on_cp`). (The stock Trainer on the same launch, worker argument ``stock``:
    3.6e-07, exact too for a causal LM: it counts before the cut and divides the gathered count by ``cp_size``.)"""
    result = run_workers(WORKER, nproc=2, method="torchrun", timeout=300)
    ranks = result.load("cp")
    ours = ranks[0]["gradacc"]
    assert ours["cp_size"] == 2 and sorted(r["gradacc"]["cp_rank"] for r in ranks) == [0, 1], ranks
    assert ours["update"]["relative_error"] <= TOLERANCE, ours
    assert ours["moved"] == ours["parameters"], ours
    print("cp 2 x FSDP2 on CPU:", ours["update"])
    refused = ranks[0]["sequence_classification"]
    assert refused["error_type"] == "GradAccConfigError" and "sequence_classification" in refused["error"], refused
    for r in ranks:  # evaluation: each batch's loss summed and counted over both ranks' chunks
        ours = r["gradacc"]
        assert abs(ours["eval_loss"] / ours["eval_reference"] - 1) <= TOLERANCE, ours
    print("cp 2 eval_loss:", [r["gradacc"]["eval_loss"] for r in ranks], "float64:", ranks[0]["gradacc"]["eval_reference"])
    check_on_cp(ranks)
    for phase in ("evaluate", "train"):  # left padding on rank 1 only: both ranks stop, agreed, none hangs
        one, other = (r["gradacc"] if phase == "evaluate" else r for r in (ranks[1], ranks[0]))
        one, other = one[f"refused_{phase}"], other[f"refused_{phase}"]
        assert one["error_type"] == "GradAccDataError" and "padding_side" in one["error"], (phase, one)
        assert other["error_type"] == "GradAccDataError" and "Rank(s) [1]" in other["error"], (phase, other)


def check_on_cp(ranks: list[dict]) -> None:
    """`hf-gradacc check` on the same launch, under the environment ``accelerate launch`` gives ``cp_fsdp2.yaml``
    (the worker's last step): the mesh and 1 data rank in the header, both causal LM rows exact for GradAccTrainer
    with the stock Trainer's numbers beside them, every other head a row refusing it under context parallelism."""
    check = ranks[0]["check"]
    assert [r["check"]["status"] for r in ranks] == [0, 0], check["stdout"]
    printed, heads = check["stdout"], check["json"]["heads"]
    assert "x 1 data rank (of 2 processes) = 8 samples per step" in printed, printed
    assert "  mesh      CP 2\n" in printed and check["json"]["setup"]["mesh"] == ranks[0]["gradacc"]["mesh"], printed
    for key in ("causal_lm", "causal_lm_no_loss_kwargs"):
        results = heads[key]["results"]
        assert results["GradAccTrainer"]["relative_error"] <= TOLERANCE, (key, results)
        stock = results["Trainer"]["relative_error"]
        assert f"{stock:.1e}" in next(line for line in printed.splitlines() if line.startswith(f"  {key} ")), printed
    refused = {k: h["skipped"] for k, h in heads.items() if not k.startswith("causal_lm")}
    assert len(refused) == 5 and all("under context parallelism" in why for why in refused.values()), refused
    print("hf-gradacc check on cp 2:", {k: heads[k]["results"] for k in ("causal_lm", "causal_lm_no_loss_kwargs")})
