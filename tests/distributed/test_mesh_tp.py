"""Tensor parallelism x FSDP2 on 4 CPU ranks (gloo): a tiny Llama sharded at load time by transformers'
``DistributedConfig(tp_size=2, fsdp_size=2)``, trained one SGD(lr=1) step by the transformers Trainer (accelerate's
MULTI_CPU refusal of a ``ParallelismConfig`` lifted by ``hf_gradacc.patches.parallelism_cpu``).

GradAccTrainer is exact on causal LM and Llama sequence classification (relative error <= 1e-5 against the float64
full batch over the 8 samples of the 2 data ranks; mixed lengths, masked prompts), through the update, ``trainer.grads``
(DTensor gradients) and the logged ``grad_norm``; the count is summed over the data group only and the loss scaled by
the data-parallel size 2, not the world size 4. The stock Trainer is shown beside it. One launch of 4 ranks for every
case (about a minute on 2 busy cores), plus TP 2 alone on 2 ranks. Expert parallelism: tests/distributed/test_mesh_ep.py;
pipeline parallelism and the expert layouts not shown exact are refused by name: tests/unit/test_tensor_parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.collective_budget import COUNT, FLAG, NORM, assert_within_budget, library, train_log
from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.scale]

WORKER = Path(__file__).resolve().parent / "workers" / "mesh_sharded_cases.py"
TOLERANCE = 1e-5
TASKS = ("causal_lm", "sequence_classification")
MODELS = {"causal_lm": "llama", "sequence_classification": "llama_seq_cls"}
TP_FSDP = {"tp_size": 2, "fsdp_size": 2}
CASES = [
    *({"name": f"{task}-gradacc", "model": MODELS[task], "sizes": TP_FSDP, "budget": True} for task in TASKS),
    *({"name": f"{task}-stock", "model": MODELS[task], "sizes": TP_FSDP, "trainer": "stock", "budget": True}
      for task in TASKS),
    {"name": "causal_lm-clipped", "model": "llama", "sizes": TP_FSDP, "max_grad_norm": 0.5, "budget": True},
    {"name": "causal_lm-clipped-stock", "model": "llama", "sizes": TP_FSDP, "max_grad_norm": 0.5, "trainer": "stock",
     "budget": True},
    {"name": "causal_lm-hook", "model": "llama", "sizes": TP_FSDP, "hook": "zero_lm_head"},
    {"name": "causal_lm-nan", "model": "llama", "sizes": TP_FSDP, "hook": "nan"},
    {"name": "fused-refused", "model": "llama", "sizes": TP_FSDP, "settings": {"fused_lm_head": True},
     "mode": "setup_error"},
    # last: `hf-gradacc check` tears the process group down
    {"name": "check", "mode": "check", "sizes": TP_FSDP},
]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    launch = run_workers(WORKER, nproc=4, args=["--cases", json.dumps(CASES)], timeout=900)
    return {case["name"]: launch.load(case["name"]) for case in CASES}


@pytest.mark.parametrize("task", TASKS)
def test_tensor_x_fsdp_step_is_the_full_batch_step(results, task):
    ranks = results[f"{task}-gradacc"]
    rank0 = ranks[0]
    assert rank0["backend"] == "TP 2 x FSDP 2, 4 processes, gloo"
    assert rank0["dp_world_size"] == 2  # the loss scale: the data group, not the world
    # the tensor ranks (0, 1) and (2, 3) see the same micro-batches; the two data ranks different ones
    assert ranks[0]["first_ids"] == ranks[1]["first_ids"] and ranks[2]["first_ids"] == ranks[3]["first_ids"]
    assert ranks[0]["first_ids"] != ranks[2]["first_ids"]
    assert rank0["num_unique_micro_batches"] == 4 and rank0["num_micro_batches_all_ranks"] == 8
    assert any("Shard(dim=1)" in p for p in rank0["param_placements"])  # a 2-D (fsdp x tp) DTensor mesh
    for what in ("update", "grad"):  # the SGD(lr=1) update, and trainer.grads in on_pre_optimizer_step
        assert rank0[what]["relative_error"] <= TOLERANCE, (what, rank0[what])
    assert rank0["unchanged"] == []
    assert rank0["logged_grad_norm"] == pytest.approx(rank0["reference_norm"], rel=1e-5)
    assert rank0["grads_norm"] == pytest.approx(rank0["reference_norm"], rel=1e-5)
    assert all(r["grads_norm"] == pytest.approx(rank0["grads_norm"], rel=1e-12) for r in ranks)


def test_stock_trainer_beside_it(results):
    """Measured, not asserted as a goal: the stock Trainer on the same mesh (docs/concepts.md quotes it)."""
    assert results["causal_lm-stock"][0]["update"]["relative_error"] <= TOLERANCE
    # measured: 4.0x, GA 2 x the data-parallel size 2 (the classifier's loss is a micro-batch mean)
    assert results["sequence_classification-stock"][0]["update"]["norm_ratio"] == pytest.approx(4.0, rel=1e-3)


def test_clipping_scales_the_whole_tensor_parallel_gradient(results):
    """max_grad_norm 0.5 (the gradient's norm is about 1.38): the update is the reference scaled to norm 0.5; the
    logged grad_norm is the pre-clip norm, reduced over the whole (fsdp x tp) mesh."""
    rank0 = results["causal_lm-clipped"][0]
    assert rank0["reference_norm"] > 1.0
    assert rank0["update"]["relative_error"] <= TOLERANCE, rank0["update"]
    assert rank0["logged_grad_norm"] == pytest.approx(rank0["reference_norm"], rel=1e-5)


def test_accumulated_gradient_hook_writes_a_tensor_sharded_gradient_back(results):
    """A hook that zeroes lm_head.weight's full gradient (a DTensor on the fsdp x tp mesh): the update is the
    reference with that gradient zero, every other parameter exact."""
    rank0 = results["causal_lm-hook"][0]
    assert rank0["update"]["relative_error"] <= TOLERANCE, rank0["update"]
    assert rank0["unchanged"] == ["lm_head.weight"]


def test_nonfinite_gradient_skips_the_step_on_every_rank(results):
    for rank in results["causal_lm-nan"]:
        assert rank["num_nonfinite_skipped"] == 1 and rank["max_abs_update"] == 0.0, rank


def test_fused_lm_head_is_refused_by_name_under_tensor_parallelism(results):
    for rank in results["fused-refused"]:
        assert rank["error_type"] == "UnsupportedBackendError" and "fused_lm_head" in rank["error"], rank


@pytest.mark.parametrize(("ours", "stock"), [("causal_lm-gradacc", "causal_lm-stock"),
                                             ("sequence_classification-gradacc", "sequence_classification-stock"),
                                             ("causal_lm-clipped", "causal_lm-clipped-stock")])  # fmt: skip
def test_collectives_the_library_adds_per_step(results, ours, stock):
    """Every collective of the step (torch.distributed and the functional collectives DTensor uses), by who asked.
    The library's own: the count all-gather on the data group (in place of the stock Trainer's num_items_in_batch
    gather), the non-finite flag, ONE all-reduce for every DTensor gradient's norm (was one per sharded parameter),
    and on the first step the start-up loss check. The model's forward, which our loss calls, is not ours (counted
    as ``@model<...``). The log line: the Trainer's own loss gathers only (no loss term to log)."""
    [our_step], [stock_step] = results[ours][0]["steps"], results[stock][0]["steps"]
    extra = assert_within_budget(our_step, stock_step, expected={COUNT: 1, FLAG: 1, NORM: 1}, first=True)
    # beyond the stock Trainer's step (which gathers its count and reduces its own norm): at most the flag
    assert extra <= 1, (our_step, stock_step)
    assert library(train_log(results[ours][0])) == {}


def test_check_command_runs_on_the_tensor_x_fsdp_mesh(results):
    """`hf-gradacc check --distributed_config tp_size=2,fsdp_size=2` in the same launch: it names the mesh, counts the
    samples of the 2 data ranks, runs the heads with a tensor plan and says which heads have none."""
    ranks = results["check"]
    assert [r["status"] for r in ranks] == [0] * 4, ranks[0]
    printed = ranks[0]["stdout"]
    assert "mesh      TP 2 x FSDP 2" in printed, printed
    assert "x 2 data ranks (of 4 processes) = 16 samples per step" in printed, printed
    assert all(r["stdout"] == "" for r in ranks[1:])  # only the main process prints
    report = ranks[0]["json"]
    assert report["setup"]["mesh"] == "TP 2 x FSDP 2" and report["is_exact"] is True
    heads = report["heads"]
    for key in ("causal_lm", "causal_lm_no_loss_kwargs"):  # tiny Llamas: they have a tensor plan
        ours = heads[key]["results"]["GradAccTrainer"]
        assert ours["relative_error"] <= TOLERANCE and ours["is_exact"] is True, (key, ours)
    assert heads["causal_lm_no_loss_kwargs"]["results"]["Trainer"]["is_exact"] is False
    for key in ("seq2seq", "masked_lm", "token_classification", "sequence_classification", "image_classification"):
        assert heads[key]["skipped"].startswith("UnsupportedBackendError: no tensor-parallel plan"), heads[key]


TP_ONLY_CASES = [
    *({"name": f"{task}-tp-only", "model": MODELS[task], "sizes": {"tp_size": 2}} for task in TASKS),
    *({"name": f"{task}-tp-only-stock", "model": MODELS[task], "sizes": {"tp_size": 2}, "trainer": "stock"}
      for task in TASKS),
]


@pytest.fixture(scope="module")
def tp_only_results() -> dict[str, list[dict]]:
    launch = run_workers(WORKER, nproc=2, args=["--cases", json.dumps(TP_ONLY_CASES)], timeout=600)
    return {case["name"]: launch.load(case["name"]) for case in TP_ONLY_CASES}


@pytest.mark.parametrize("task", TASKS)
def test_tensor_parallel_alone_is_the_full_batch_step(tp_only_results, task):
    """TP 2 on 2 ranks (no FSDP): both ranks hold the same samples, nothing is counted twice, the loss is not scaled."""
    ranks = tp_only_results[f"{task}-tp-only"]
    rank0 = ranks[0]
    assert rank0["backend"] == "TP 2, 2 processes, gloo" and rank0["dp_world_size"] == 1
    assert ranks[0]["first_ids"] == ranks[1]["first_ids"]
    for what in ("update", "grad"):
        assert rank0[what]["relative_error"] <= TOLERANCE, (what, rank0[what])
    assert rank0["unchanged"] == []
    assert rank0["logged_grad_norm"] == pytest.approx(rank0["reference_norm"], rel=1e-5)


def test_stock_trainer_beside_tensor_parallel_alone(tp_only_results):
    """Measured (docs/backends.md quotes it): causal LM exact; the classifier's micro-batch means summed, GA 2 = 2.0x."""
    assert tp_only_results["causal_lm-tp-only-stock"][0]["update"]["relative_error"] <= TOLERANCE
    assert tp_only_results["sequence_classification-tp-only-stock"][0]["update"]["norm_ratio"] == pytest.approx(
        2.0, rel=1e-3
    )
