"""Data-parallel meshes past one flat group: HSDP (2 replicas x 2 shards), 2 simulated nodes x 2 processes, the
world check at start (the pdsh split of a DeepSpeed multi-node launch is refused), and the collectives the library
adds per optimizer step.

The tolerance is the project's: relative error <= 1e-5 against the float64 full-batch reference over every rank's
samples (float32 training), causal LM and sequence classification, mixed lengths and heavy padding. The 4-rank
tests are marked ``scale`` (about a minute each on 2 busy cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.distributed.collective_budget import COUNT, FLAG, assert_within_budget, library, train_log
from tests.distributed.launcher import find_free_port, kill_tree, launch_env, run_accelerate, run_workers

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
CONFIGS = REPO / "examples" / "accelerate_configs"
TOLERANCE = 1e-5
HSDP = {"dp_replicate_size": 2, "dp_shard_size": 2}
BERT_WRAP = {"transformer_layer_cls_to_wrap": ["BertLayer"]}


def _assert_exact(comparison: dict[str, float], what: str) -> None:
    assert comparison["relative_error"] <= TOLERANCE, f"{what}: {comparison}"
    assert comparison["cosine"] > 1 - 1e-9, f"{what}: {comparison}"


# ---------------------------------------------------------------------------------------------- HSDP
# clipping on for the causal LM pair (the gradient's norm is far below 1e6: the update is unclipped), off for the
# classifier pair; every case counts its step's collectives (tests/distributed/collective_budget.py)
HSDP_CASES = [
    {"name": "hsdp-causal_lm", "task": "causal_lm", "fsdp_sync": "deferred", "parallelism": HSDP, "budget": True,
     "max_grad_norm": 1e6},
    {"name": "hsdp-stock-causal_lm", "task": "causal_lm", "trainer": "stock", "parallelism": HSDP, "budget": True,
     "max_grad_norm": 1e6},
    {"name": "hsdp-sequence_classification", "task": "sequence_classification", "fsdp_sync": "defer_all_reduce",
     "parallelism": HSDP, "fsdp_config": BERT_WRAP, "budget": True},
    {"name": "hsdp-stock-sequence_classification", "task": "sequence_classification", "trainer": "stock",
     "parallelism": HSDP, "fsdp_config": BERT_WRAP, "budget": True},
]


@pytest.fixture(scope="module")
def hsdp() -> dict[str, dict]:
    """TrainingArguments(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)) on 4 ranks."""
    launch = run_workers(WORKERS / "fsdp2_cases.py", nproc=4, args=["--cases", json.dumps(HSDP_CASES)], timeout=480)
    return {case["name"]: launch.load(case["name"])[0] for case in HSDP_CASES}


@pytest.mark.scale
def test_hsdp_2x2_is_exact_on_both_heads_and_stock_is_not(hsdp):
    for case in HSDP_CASES:
        rank0 = hsdp[case["name"]]
        assert rank0["mesh"] == "HSDP 2 x 2", rank0["mesh"]
        assert rank0["param_types"] == ["DTensor"]
        if case.get("trainer") == "stock":  # the stock Trainer's step, for the docs
            if case["task"] == "sequence_classification":
                assert rank0["update"]["norm_ratio"] > 10, rank0["update"]
            continue
        _assert_exact(rank0["update"], case["name"])
        assert rank0["unchanged"] == [] and rank0["missing"] == []
        # the cross-replica all-reduce runs once per optimizer step, in the final backward
        all_reduces = [mb["all_reduce"] for mb in rank0["per_micro_batch"]]
        assert all_reduces[:3] == [0, 0, 0] and all_reduces[3] > 0, all_reduces


@pytest.mark.scale
@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
def test_hsdp_collectives_per_step(hsdp, task):
    """Ours against the stock Trainer on the HSDP 2 x 2 mesh (measured: causal LM deferred, clipping on, 39 / 38;
    classifier defer_all_reduce, clipping off, 51 / 38 of which 12 are the reduce-scatters it adds by design)."""
    ours, stock = hsdp[f"hsdp-{task}"], hsdp[f"hsdp-stock-{task}"]
    [our_step], [stock_step] = ours["steps"], stock["steps"]
    by_design = 0
    if task == "sequence_classification":  # defer_all_reduce reduce-scatters inside the replica on every micro-batch
        scatters, theirs = (s["calls"]["reduce_scatter_single@accelerate"] for s in (our_step, stock_step))
        assert scatters == 4 * theirs  # GA 4
        by_design = scatters - theirs
    extra = assert_within_budget(our_step, stock_step, expected={COUNT: 1, FLAG: 1}, first=True, by_design=by_design)
    assert extra == 1, (our_step, stock_step)  # the flag; the count gather replaces the stock num_items_in_batch one
    # the log line: the Trainer's own loss gathers only (no loss term, no expert load to log)
    assert library(train_log(ours)) == {} and train_log(ours)["total"] == train_log(stock)["total"]


@pytest.mark.scale
def test_hsdp_cpu_yaml_builds_the_2d_mesh():
    """The shipped examples/accelerate_configs/hsdp_cpu.yaml, through `accelerate launch` (4 ranks)."""
    out = Path(tempfile.mkdtemp(prefix="hf_gradacc_hsdp_yaml_"))
    case = {"name": "yaml-causal_lm", "task": "causal_lm", "fsdp_sync": "defer_all_reduce"}
    done = run_accelerate(CONFIGS / "hsdp_cpu.yaml", WORKERS / "fsdp2_cases.py",
                          ["--cases", json.dumps([case]), "--launcher", "accelerate"], cpu_distributed=True,
                          timeout=420, out_dir=out, nproc=4, check=False)
    assert done.returncode == 0, done.output[-6000:]
    rank0 = json.loads((out / "yaml-causal_lm.rank0.json").read_text())
    assert rank0["mesh"] == "HSDP 2 x 2", rank0["mesh"]
    _assert_exact(rank0["update"], "hsdp_cpu.yaml")
    # defer_all_reduce: reduce-scatter inside the replica every micro-batch, the all-reduce across replicas once
    assert [mb["all_reduce"] for mb in rank0["per_micro_batch"]][:3] == [0, 0, 0]
    assert all(mb["reduce_scatter"] > 0 for mb in rank0["per_micro_batch"])


# ---------------------------------------------------------------------------------------------- multi-node
def _launch_machines(config: Path, machine_ranks: tuple[int, ...], cases: str, out: Path, timeout: float,
                     *, cpu_distributed: bool = False) -> list[tuple[int | None, str]]:
    """`accelerate launch --num_machines 2 --num_processes 4 --machine_rank R` for each R, on localhost against one
    master port, run in ``out`` (DeepSpeed's multi-node path writes a .deepspeed_env file into the working dir)."""
    port = find_free_port()
    env = launch_env(out, hide_gpus=True, cpu_distributed=cpu_distributed)
    procs = []
    for machine_rank in machine_ranks:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_machines", "2", "--num_processes", "4", "--machine_rank", str(machine_rank),
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
               str(WORKERS / "mesh_cases.py"), "--cases", cases]
        log = open(out / f"machine{machine_rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True), log))
    deadline = time.monotonic() + timeout
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.01)))
        except subprocess.TimeoutExpired:
            codes.append(None)
        finally:
            kill_tree(proc)
            log.close()
    return [(code, (out / f"machine{r}.log").read_text()) for r, code in zip(machine_ranks, codes, strict=True)]


NODE_TASKS = ("causal_lm", "sequence_classification")
NODE_BUDGETS = ("budget_ddp", "budget_ddp_clipped")


@pytest.fixture(scope="module")
def two_nodes() -> Path:
    """`accelerate launch --num_machines 2 --machine_rank R` (DDP, ddp_cpu.yaml) on 2 simulated nodes x 2: the
    exactness cases, then 3 steps of ours and of the stock Trainer with their collectives counted (clipping off, on)."""
    out = Path(tempfile.mkdtemp(prefix="hf_gradacc_2nodes_"))
    cases = ",".join([*(f"multinode_{t}" for t in NODE_TASKS), *NODE_BUDGETS])
    done = _launch_machines(CONFIGS / "ddp_cpu.yaml", (0, 1), cases, out, 480)
    assert all(code == 0 for code, _ in done), [output[-4000:] for _, output in done]
    return out


@pytest.mark.scale
def test_two_nodes_ddp_is_exact(two_nodes):
    for task in NODE_TASKS:
        ranks = [json.loads((two_nodes / f"multinode_{task}.rank{r}.json").read_text()) for r in range(4)]
        assert [r["dist_world"] for r in ranks] == [4] * 4
        assert {r["mesh"]["describe"] for r in ranks} == {"DDP 4, 2 nodes x 2"}
        assert [r["world"] for r in ranks] == [{"launcher": "torchrun", "nodes": 2, "per_node": 2}] * 4
        gradacc, stock = ranks[0]["gradacc"], ranks[0]["stock"]
        assert gradacc["num_processes"] == 4
        _assert_exact(gradacc, f"2 nodes x 2, {task}")
        assert gradacc["unchanged_params"] == []
        if task == "sequence_classification":  # the stock Trainer, beside ours (docs/backends.md)
            assert stock["norm_ratio"] > 10, stock


@pytest.mark.scale
@pytest.mark.parametrize("name", NODE_BUDGETS)
def test_two_nodes_collectives_per_step(two_nodes, name):
    """Measured: 3 / 2 per step, clipping on and off (DDP's norm is local: no collective), the first step 4 / 2."""
    run = json.loads((two_nodes / f"{name}.rank0.json").read_text())
    _assert_budget(run, name)


def test_pdsh_split_of_a_deepspeed_multinode_launch_is_refused():
    """`accelerate launch --num_machines 2` with zero2_cpu.yaml (no `deepspeed_multinode_launcher: standard`) on a
    machine without a hostfile: DeepSpeed's launcher runs a world of 2 on local resources only. Both ranks of that
    world stop at trainer construction with our error, naming the config line (one machine's launch: 2 ranks)."""
    out = Path(tempfile.mkdtemp(prefix="hf_gradacc_pdsh_"))
    [(code, output)] = _launch_machines(CONFIGS / "zero2_cpu.yaml", (0,), "construct_only", out, 300,
                                        cpu_distributed=True)
    assert "local resources only" in output, output[-4000:]  # the launch really split
    assert code != 0, output[-4000:]
    assert output.count("GradAccConfigError") >= 2 and "deepspeed_multinode_launcher: standard" in output, (
        output[-6000:]
    )


def test_fsdp_by_distributed_config_without_tensor_parallelism_is_refused_by_name():
    """`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))` (HSDP with dp_replicate_size too):
    transformers 5.24's Trainer trains it (the stock step is exact on causal LM, measured), but accelerate sets up
    plain DDP for it, which GradAccTrainer would drive wrong; refused at construction, naming the supported route."""
    launch = run_workers(WORKERS / "mesh_cases.py", nproc=2, args=["--cases", "construct_distributed_config"],
                         timeout=300, check=False)
    assert not launch.ok
    output = launch.describe()
    assert "UnsupportedBackendError" in output and "parallelism_config=ParallelismConfig(" in output, output[-6000:]


# ---------------------------------------------------------------------------------------------- collective budget
# budget_ddp_preemption: save_on_preemption on, its flag rides in the non-finite all-reduce (no new collective)
BUDGETS = ["budget_ddp", "budget_ddp_preemption", "budget_fsdp2_deferred", "budget_fsdp2_every_micro_batch"]


@pytest.fixture(scope="module")
def budget() -> dict[str, dict]:
    names = [*BUDGETS, "strided_shard_norms"]
    launch = run_workers(WORKERS / "mesh_cases.py", nproc=2, args=["--cases", ",".join(names)], timeout=400)
    return {name: launch.load(name)[0] for name in names}


def _assert_budget(run: dict, name: str) -> None:
    """Three optimizer steps (GA 4) of ours and of the stock Trainer on the same mesh (mesh_cases.py budget_*)."""
    gradacc, stock = run["gradacc"], run["stock"]
    assert gradacc["global_step"] == stock["global_step"] == 3
    assert gradacc["mesh"] == stock["mesh"]
    for index, (ours, theirs) in enumerate(zip(gradacc["steps"], stock["steps"], strict=True)):
        by_design = 0
        if name.endswith("every_micro_batch"):  # every_micro_batch reduce-scatters on every micro-batch by design
            scatters = ours["calls"]["reduce_scatter_single@accelerate"]
            assert scatters == 4 * theirs["calls"]["reduce_scatter_single@accelerate"]  # GA 4
            by_design = scatters - theirs["calls"]["reduce_scatter_single@accelerate"]
        extra = assert_within_budget(ours, theirs, expected={COUNT: 1, FLAG: 1}, first=index == 0, by_design=by_design)
        # our count gather replaces the stock `num_items_in_batch` gather: the non-finite flag is the one more
        assert extra == 1, (index, ours, theirs)


@pytest.mark.parametrize("name", BUDGETS)
def test_the_library_adds_one_count_and_one_flag_per_step(budget, name):
    _assert_budget(budget[name], name)


def test_fsdp2_gradient_norm_counts_a_strided_shard(budget):
    """FSDP2Backend.grad_sq_norms on a DTensor gradient placed ``_StridedShard`` (fully_shard over a tensor-parallel
    dimension; in torch 2.13 no ``Shard`` subclass, ``is_shard()`` False) beside a plain gradient, in the same 2-rank
    launch: each entry is the full gradient's squared norm (with only ``Shard`` taken as a cut, each rank reported
    its own shard's: 8.6 and 15.0 of 23.6)."""
    run = budget["strided_shard_norms"]
    assert run["placements"] == "(_StridedShard(dim=0, sf=2),)" and run["local_rows"] == 4
    assert run["squares"] == pytest.approx(run["expected"], rel=1e-12)
