"""DeepSpeed Ulysses sequence parallelism (accelerate ``sp_size`` 2, ``sp_backend="deepspeed"``) with ZeRO-2 on 2 CPU
ranks (gloo), launched as users launch it: ``accelerate launch --config_file zero2_cpu.yaml`` with
``HF_GRADACC_CPU_DISTRIBUTED=1`` and ``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2, ...))``.

Each rank holds half of every sequence; the targets are counted once over the sequence group (and the data group,
here of one rank), and ZeRO sums the sequence shards' gradients (it divides by the data ranks only), so the loss is
scaled by the data ranks, not by the world. Exact: relative gradient error <= 1e-5 against the float64 full batch.
ZeRO-3 with ``sp_size`` > 1 is refused by name (it scales the shards' gradients otherwise).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.distributed.launcher import run_accelerate  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "sequence_parallel_cases.py"
TOLERANCE = 1e-5

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _launch(stage: int, num_processes: int = 2) -> list[dict]:
    config = REPO / "examples" / "accelerate_configs" / f"zero{stage}_cpu.yaml"
    out_dir = tempfile.mkdtemp(prefix="hf_gradacc_sp_")
    if num_processes != 2:
        text = config.read_text().replace("num_processes: 2", f"num_processes: {num_processes}")
        config = Path(out_dir) / config.name
        config.write_text(text)
    result = run_accelerate(
        config,
        WORKER,
        ["--trainer", "gradacc", "--batch", "2"],
        cpu_distributed=True,
        nproc=num_processes,
        timeout=300.0 * num_processes / 2,
        out_dir=out_dir,
    )
    return result.load("gradacc")


def test_ulysses_sequence_parallel_zero2_is_exact():
    ranks = _launch(2)
    for payload in ranks:
        assert payload["outcome"] == "trained", payload.get("traceback", payload)
        assert payload["global_step"] == 1
        assert payload["num_unchanged"] == 0  # every trainable parameter moved
        assert payload["relative_error"] <= TOLERANCE, payload
    assert ranks[0]["relative_error"] == ranks[1]["relative_error"]  # one model after the step
    # the library's own collectives in the step: the count all-gather, the non-finite flag, the gradient norm's one
    # all-reduce, and (first step) the start-up loss check; the sequence all-to-alls and gathers are DeepSpeed's
    for payload in ranks:
        [step] = payload["steps"]
        library = {k: n for k, n in step["calls"].items() if "@hf_gradacc" in k}
        assert library == {
            "all_gather@hf_gradacc:all_gather<agree<train_window": 1,
            "all_gather@hf_gradacc:all_gather<gather_window_counts<prefetched": 1,
            "all_reduce@hf_gradacc:agreed_nonfinite<must_skip<optimizer_step": 1,
            "all_reduce@hf_gradacc:grad_sq_norms<clip_grad_norm<optimizer_step": 1,
        }, step


def test_ulysses_sequence_parallel_zero3_is_refused_by_name():
    # ZeRO-3 scales the sequence shards' gradients otherwise (measured: 0.50x the full batch with sp 2)
    for payload in _launch(3):
        assert payload["outcome"] == "error", payload
        assert payload["error_type"] == "UnsupportedBackendError"
        assert "ZeRO-3 with Ulysses sequence parallelism" in payload["error"]
        assert "zero_stage: 1" in payload["error"]


@pytest.mark.scale
def test_ulysses_sequence_parallel_times_data_parallel_zero2_is_exact():
    # sp 2 x data 2 on 4 ranks: counted over all 4, the loss scaled by the 2 data ranks ZeRO divides by
    ranks = _launch(2, num_processes=4)
    assert len(ranks) == 4
    for payload in ranks:
        assert payload["outcome"] == "trained", payload.get("traceback", payload)
        assert payload["num_unchanged"] == 0
        assert payload["relative_error"] <= TOLERANCE, payload
