"""``total_train_batch_size`` across a change of world size: a run stopped on 2 processes and resumed on 1 and on 3,
with the same arguments, trains the samples the uninterrupted 2-process run trained in each step and ends on its
weights (relative to the parameter change, <= 1e-5), with its ``max_steps`` and learning rates; on DDP, FSDP2 and
DeepSpeed ZeRO-2 and ZeRO-3.

Run A: 2 ranks, 36 samples, per-device batch 2, ``total_train_batch_size=12`` (GA 3), linear decay, 3 steps, a
checkpoint after each; a causal LM and a sequence classifier (one launch, a run per head:
:mod:`workers.resume_layout_cases`). Its checkpoint-1 is resumed with the same arguments on 1 process (GA 6) and on
3 ranks (GA 2).

- DDP (SGD with momentum): the 1-process resume in the test's own process.
- FSDP2 with ``state_dict_type: SHARDED_STATE_DICT`` (torch DCP: the model and the momentum saved in 2 shards, loaded
  into 1 and 3). The Trainer's default ``FULL_STATE_DICT`` (full tensors, no resharding) is covered by the same path.
- ZeRO-2 (AdamW): its optimizer state is partitioned per rank and DeepSpeed loads it only on the world that saved it.
  The resume on 1 process is refused when ``train()`` starts, before anything is loaded, naming DeepSpeed's
  ``ds_to_universal`` command and the ``checkpoint.load_universal`` config; the command run as printed, then the
  resume with ``load_universal`` on 1 and on 3 ranks is exact.
- ZeRO-3 (AdamW, ``examples/accelerate_configs/zero3_cpu.yaml``'s settings):
  the same, the refusal naming the partitioned parameters. DeepSpeed 0.19.8's ZeRO-3 universal load shares one Adam
  step counter between the sub-groups (1.9e-02 off on 1 and on 2 ranks without the backend's repair).

HSDP (``scale``, one 4-rank launch and one 2-rank launch): 48 samples, per-device batch 2, total 16, stopped after
step 1 of 3 as HSDP 2 x 2 (GA 2 on 4 data ranks, ``SHARDED_STATE_DICT``) and resumed on 2 ranks as FSDP 2 (GA 4):
the 2-node job that lost a node, whose remaining ranks still shard (``dp_replicate_size`` 2 -> 1; accelerate refuses
the other 2-rank shape, HSDP 2 x 1: nothing left for FSDP to shard over).

A total the new world cannot hold (12 on 5 data ranks of 2) is refused at construction, naming the totals that fit
(``tests/unit/test_total_train_batch_size.py``).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_gradacc.testing.tiny import build_tiny_model
from tests.distributed.launcher import launch_env, run_workers
from tests.distributed.workers.resume_layout_cases import TOTAL_RUN, train_run

WORKER = Path(__file__).resolve().parent / "workers" / "resume_layout_cases.py"
TASKS = ("causal_lm", "sequence_classification")
TOTAL, BATCH, NUM_SAMPLES = 12, 2, 36  # 12 = 2 x GA 6 x 1 = 2 x 3 x 2 = 2 x 2 x 3: 3 steps
ACCUMULATION = {1: 6, 2: 3, 3: 2}

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _launch(tmp: Path, name: str, nproc: int, backend: str, *args: str, check: bool = True, total: int = TOTAL,
            num_samples: int = NUM_SAMPLES) -> list[dict]:  # fmt: skip
    result = run_workers(
        WORKER,
        nproc=nproc,
        args=["--name", name, "--batch", str(BATCH), "--ga", "1", "--total", str(total), "--tasks", ",".join(TASKS),
              "--num-samples", str(num_samples), "--backend", backend, *args],
        timeout=400,
        out_dir=tmp / "results",
        check=check,
    )  # fmt: skip
    ranks = result.load(name)
    for r, payload in enumerate(ranks):
        if check and "error" in payload:
            pytest.fail(f"rank {r} failed:\n{payload['error']}", pytrace=False)
    return ranks


@pytest.fixture(scope="module", params=["ddp", "fsdp2_sharded", "zero2", "zero3"])
def run_a(request, tmp_path_factory) -> tuple[str, Path, dict]:
    """The uninterrupted 2-process run, one per head (rank 0's result)."""
    tmp = tmp_path_factory.mktemp(f"a_{request.param}")
    return request.param, tmp, _launch(tmp, "a", 2, request.param, "--out", str(tmp / "a"))[0]


def relative_change_error(params: dict, reference: dict, task: str) -> float:
    """|params - reference| / |reference - initial|: the error relative to the uninterrupted run's update."""
    start = dict(build_tiny_model(task, seed=0).named_parameters())
    num = sum(((torch.tensor(params[n]) - torch.tensor(reference[n])) ** 2).sum() for n in reference)
    den = sum(((torch.tensor(reference[n]) - start[n].detach()) ** 2).sum() for n in reference)
    return float((num / den).sqrt())


def _assert_like_a(a: dict, b: dict, task: str, world: int) -> float:
    assert a["gradient_accumulation_steps"] == 3 and b["gradient_accumulation_steps"] == ACCUMULATION[world]
    assert a["max_steps"] == b["max_steps"] == 3 and b["global_step"] == 3
    assert [len(ids) for _, ids in a["steps"]] == [TOTAL] * 3
    assert [(step, sorted(ids)) for step, ids in b["steps"]] == [(s, sorted(i)) for s, i in a["steps"] if s >= 1]
    assert b["learning_rates"] == pytest.approx(a["learning_rates"], rel=1e-7)  # the history holds step 1 too
    layout = [m for m in b["warnings"] if f"world_size 2 -> {world}" in m]
    assert len(layout) == 1 and f"gradient_accumulation_steps 3 -> {ACCUMULATION[world]}" in layout[0], b["warnings"]
    error = relative_change_error(b["params"], a["params"], task)
    assert error <= 1e-5, (task, error)
    return error


def _to_universal(tmp: Path, tmp_path: Path, backend: str) -> str:
    """ZeRO-2 / ZeRO-3: the resume on 1 process refused by name; DeepSpeed's command from the message run as printed
    for each head's checkpoint-1. The backend that loads the universal checkpoint."""
    ranks = _launch(tmp_path, "refused", 1, backend, "--out", str(tmp_path / "refused"),
                    "--resume", str(tmp / "a" / "{task}" / "checkpoint-1"), check=False)  # fmt: skip
    message = ranks[0].get("error", "")
    held = "ZeRO-3 parameters and optimizer state are" if backend == "zero3" else "ZeRO optimizer state is"
    assert "GradAccConfigError" in message and f"{held} partitioned over 2 data ranks" in message, message
    assert '`"checkpoint": {"load_universal": true}`' in message, message
    assert "ZeRORuntimeException" not in message, message  # refused before DeepSpeed loads anything
    command = re.search(r"`(python -m deepspeed\.checkpoint\.ds_to_universal [^`]+)`", message)
    assert command is not None, message
    for task in TASKS:
        line = command.group(1).replace(str(tmp / "a" / TASKS[0]), str(tmp / "a" / task)).split()
        subprocess.run([sys.executable, *line[1:]], check=True, env=launch_env(), capture_output=True, timeout=300)
        assert (tmp / "a" / task / "checkpoint-1" / "latest_universal").is_file(), shlex.join(line)
    return f"{backend}_universal"


def test_resumed_on_1_process_equals_the_2_process_run(run_a, tmp_path) -> None:
    backend, tmp, a = run_a
    resume = str(tmp / "a" / "{task}" / "checkpoint-1")
    if backend == "ddp":
        b = {
            task: train_run(str(tmp_path / task), batch=BATCH, ga=1, task=task, num_samples=NUM_SAMPLES,
                            total_train_batch_size=TOTAL, resume=resume.format(task=task), **TOTAL_RUN)
            for task in TASKS
        }  # fmt: skip
    else:
        if backend.startswith("zero"):
            backend = _to_universal(tmp, tmp_path, backend)
        b = _launch(tmp_path, "b", 1, backend, "--out", str(tmp_path / "b"), "--resume", resume)[0]
    for task in TASKS:
        print(f"\n{run_a[0]} {task} 2 -> 1: {_assert_like_a(a[task], b[task], task, world=1):.2e}")


def test_resumed_on_3_processes_equals_the_2_process_run(run_a, tmp_path) -> None:
    backend, tmp, a = run_a
    if backend.startswith("zero"):
        if not (tmp / "a" / TASKS[0] / "checkpoint-1" / "latest_universal").is_file():
            _to_universal(tmp, tmp_path, backend)
        backend = f"{backend}_universal"
    resume = str(tmp / "a" / "{task}" / "checkpoint-1")
    for c in _launch(tmp_path, "c", 3, backend, "--out", str(tmp_path / "c"), "--resume", resume):
        for task in TASKS:
            print(f"\n{run_a[0]} {task} 2 -> 3: {_assert_like_a(a[task], c[task], task, world=3):.2e}")


# HSDP: 4 ranks as 2 replicas x 2 shards (2 nodes of 2 GPUs), resumed on 2 as FSDP 2 (one node left: its 2 ranks
# still shard, nothing to replicate over); per-device batch 2, total 16: GA 2 on 4 data ranks, GA 4 on 2
HSDP_TOTAL, HSDP_SAMPLES = 16, 48


@pytest.mark.scale
def test_hsdp_2x2_resumed_as_fsdp_2_equals_the_hsdp_run(tmp_path) -> None:
    """HSDP 2 x 2 on 4 ranks (``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)``, ``SHARDED_STATE_DICT``),
    stopped after step 1 of 3, resumed with the same arguments on 2 ranks as FSDP 2 (``dp_replicate_size=1``): the
    4-rank run's samples per step, its learning rates, its weights (the DCP shards of 4 ranks loaded into 2)."""
    a = _launch(tmp_path, "a", 4, "fsdp2_sharded", "--out", str(tmp_path / "a"), "--parallelism", "2x2",
                total=HSDP_TOTAL, num_samples=HSDP_SAMPLES)[0]  # fmt: skip
    resume = str(tmp_path / "a" / "{task}" / "checkpoint-1")
    b = _launch(tmp_path, "b", 2, "fsdp2_sharded", "--out", str(tmp_path / "b"), "--parallelism", "1x2",
                "--resume", resume, total=HSDP_TOTAL, num_samples=HSDP_SAMPLES)[0]  # fmt: skip
    for task in TASKS:
        assert (a[task]["mesh"], a[task]["data_parallel_size"]) == ("HSDP 2 x 2", 4), a[task]["mesh"]
        assert (b[task]["mesh"], b[task]["data_parallel_size"]) == ("FSDP 2", 2), b[task]["mesh"]
        record = json.loads((tmp_path / "a" / task / "checkpoint-1" / "hf_gradacc_data.json").read_text())
        assert (record["world_size"], record["data_parallel_size"]) == (4, 4), record
        assert a[task]["gradient_accumulation_steps"] == 2 and b[task]["gradient_accumulation_steps"] == 4
        assert a[task]["max_steps"] == b[task]["max_steps"] == 3 and b[task]["global_step"] == 3
        assert [len(ids) for _, ids in a[task]["steps"]] == [HSDP_TOTAL] * 3
        assert [(s, sorted(i)) for s, i in b[task]["steps"]] == [(s, sorted(i)) for s, i in a[task]["steps"] if s >= 1]
        assert b[task]["learning_rates"] == pytest.approx(a[task]["learning_rates"], rel=1e-7)
        layout = [m for m in b[task]["warnings"] if "world_size 4 -> 2" in m]
        assert len(layout) == 1, b[task]["warnings"]
        assert "gradient_accumulation_steps 2 -> 4" in layout[0] and "data_parallel_size 4 -> 2" in layout[0], layout
        error = relative_change_error(b[task]["params"], a[task]["params"], task)
        print(f"\nhsdp {task} HSDP 2 x 2 -> FSDP 2: {error:.2e}")
        assert error <= 1e-5, (task, error)
