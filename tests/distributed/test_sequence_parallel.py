"""DeepSpeed Ulysses sequence parallelism (accelerate ``sp_size`` 2, ``sp_backend="deepspeed"``) with ZeRO-2 on 2 CPU
ranks (gloo), launched as users launch it: ``accelerate launch --config_file zero2_cpu.yaml`` with
``HF_GRADACC_CPU_DISTRIBUTED=1`` and ``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2, ...))``.

Each rank holds half of every sequence; the targets are counted once over the sequence group (and the data group,
here of one rank), and ZeRO sums the sequence shards' gradients (it divides by the data ranks only), so the loss is
scaled by the data ranks, not by the world. Exact: relative gradient error <= 1e-5 against the float64 full batch.
ZeRO-3 with ``sp_size`` > 1 is refused by name (it scales the shards' gradients otherwise). Left padding is refused by
name on every rank before any forward (Ulysses drops the attention mask: measured 0.41 off the full batch without the
refusal); right padding with the mask kept is exact.

The ZeRO-2 launch uses the shipped ``sp_zero2_cpu.yaml`` and then runs ``hf-gradacc check`` in the same processes,
which reads ``parallelism_config_sp_size`` from that config: SP 2 printed as the mesh, the causal LMs exact, every
other head refused by name.
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


def _launch(stage: int, num_processes: int = 2, *, config_name: str | None = None, check: bool = False,
            paddings: tuple[str, ...] = ()):  # fmt: skip
    config = REPO / "examples" / "accelerate_configs" / (config_name or f"zero{stage}_cpu.yaml")
    out_dir = tempfile.mkdtemp(prefix="hf_gradacc_sp_")
    if num_processes != 2:
        text = config.read_text().replace("num_processes: 2", f"num_processes: {num_processes}")
        config = Path(out_dir) / config.name
        config.write_text(text)
    result = run_accelerate(
        config,
        WORKER,
        ["--trainer", "gradacc", "--batch", "2", *(["--check"] if check else []),
         *(["--paddings", ",".join(paddings)] if paddings else [])],
        cpu_distributed=True,
        nproc=num_processes,
        timeout=(420.0 if check else 300.0) * num_processes / 2,
        out_dir=out_dir,
    )
    if paddings:
        return {p: result.load("gradacc" if p == "right" else f"gradacc-{p}") for p in paddings}
    return (result.load("gradacc"), result.load("check")) if check else result.load("gradacc")


def test_ulysses_sequence_parallel_zero2_is_exact():
    # the shipped sp_zero2_cpu.yaml (its `parallelism_config` block agrees with the worker's ParallelismConfig), then
    # `hf-gradacc check` in the same launch, reading the mesh from that config as users run it
    ranks, checks = _launch(2, config_name="sp_zero2_cpu.yaml", check=True)
    _assert_check_on_sp2(checks)
    for payload in ranks:
        assert payload["outcome"] == "trained", payload.get("traceback", payload)
        assert payload["global_step"] == 1
        assert payload["num_unchanged"] == 0  # every trainable parameter moved
        assert payload["relative_error"] <= TOLERANCE, payload
        assert payload["step_samples"] == [payload["num_samples"]], payload  # each row once over the sequence group
    assert ranks[0]["relative_error"] == ranks[1]["relative_error"]  # one model after the step
    # the library's own collectives in the step: the count all-gather, the non-finite flag, the gradient norm's one
    # all-reduce, and (first step) the start-up loss check; the sequence all-to-alls and gathers are DeepSpeed's
    for payload in ranks:
        [step] = payload["steps"]
        library = {k: n for k, n in step["calls"].items() if "@hf_gradacc" in k}
        assert library == {
            "all_gather@hf_gradacc:all_gather<agree<train_window": 1,
            "all_gather@hf_gradacc:all_gather<gather_window_counts<prefetched": 1,
            "all_reduce@hf_gradacc:sum_over_processes<agreed_flags<step_verdict": 1,
            "all_reduce@hf_gradacc:grad_sq_norms<clip_grad_norm<optimizer_step": 1,
        }, step


def _assert_check_on_sp2(checks: list[dict]) -> None:
    """`hf-gradacc check` on SP 2 (2 ranks, one data rank): both causal LM rows exact, the other heads refused by
    name, the header naming the mesh, and the step's samples those of the one data rank the sequence group shares."""
    for payload in checks:
        assert payload["status"] == 0, payload.get("traceback", payload.get("stdout", payload))
    data, printed = checks[0]["json"], checks[0]["stdout"]
    setup = data["setup"]
    assert setup["mesh"] == "SP 2" and "  mesh      SP 2\n" in printed, (setup, printed)
    assert "Ulysses sequence parallel 2" in setup["backend"], setup
    # batch 2 x GA 4 x 1 data rank: the two ranks hold slices of the same 8 samples, counted once over the group
    assert setup["world_size"] == 2 and setup["data_ranks"] == 1 and setup["num_samples"] == 8, setup
    assert "x 1 data rank (of 2 processes) = 8 samples per step" in printed, printed
    heads = data["heads"]
    for key in ("causal_lm", "causal_lm_no_loss_kwargs"):
        ours, stock = heads[key]["results"]["GradAccTrainer"], heads[key]["results"]["Trainer"]
        assert ours["relative_error"] <= TOLERANCE, (key, ours)
        # the stock Trainer's Ulysses loss (transformers' deepspeed_sp_compute_loss) on the same batches
        assert stock["relative_error"] > 1.0 and not stock["is_exact"], (key, stock)
    for key in ("seq2seq", "masked_lm", "token_classification", "sequence_classification", "image_classification"):
        assert "cannot train under Ulysses sequence parallelism" in heads[key]["skipped"], (key, heads[key])
    assert data["is_exact"] is True
    assert printed.count("GradAccTrainer is exact on all 2 heads that ran (5 skipped)") == 1, printed


def test_ulysses_left_padding_is_refused_by_name_on_every_rank_and_right_padding_with_its_mask_is_exact():
    """The same samples, one launch: left-padded (the attention mask kept, as a tokenizer with ``padding_side="left"``
    gives it) every rank stops with a GradAccDataError before any forward, naming left padding and the way out, or
    the rank that saw it (without the check: 0.41 relative error, the real tokens attending to the padding that
    Ulysses' attention no longer masks); right-padded with the mask kept: exact, nothing refused."""
    runs = _launch(2, paddings=("left", "right-mask"))
    for payload in runs["left"]:
        assert payload["outcome"] == "error" and payload["error_type"] == "GradAccDataError", payload
        assert ("left padding" in payload["error"] and "padding_side" in payload["error"]) or "Rank(s)" in payload[
            "error"], payload
    assert any("sp_size` 2" in p["error"] for p in runs["left"])
    for payload in runs["right-mask"]:
        assert payload["outcome"] == "trained", payload.get("traceback", payload)
        assert payload["num_unchanged"] == 0 and payload["relative_error"] <= TOLERANCE, payload


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
        assert payload["step_samples"] == [payload["num_samples"]], payload  # sp 2 x data 2: 2 data ranks' rows
