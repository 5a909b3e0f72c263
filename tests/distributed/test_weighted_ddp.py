"""Weighted losses (``loss_weights``) under DDP on 2 CPU ranks (gloo), per-device batch 2 x GA 4: the step's
denominator is the weight sum of every rank's counted targets (one count collective), exact against the float64
full batch of all 16 samples (relative error <= 1e-5) with per-token weights (per-sample, packed and regrouped
weights: tests/unit/test_weighted_loss.py); the same step with ONE token's weight missing from rank 1's sum fails
the check. Worker: workers/weighted_cases.py.

The same launch (no launch of their own) runs vision-language models on 2 ranks (workers/vlm_cases.py): a tiny LLaVA
and a tiny Qwen2.5-VL (``accepts_loss_kwargs = False``) built from their configs, one image per sample, prompts and
image tokens masked, 2 x GA 4 per rank: GradAccTrainer exact against the float64 full batch of both ranks' 16
samples; the stock Trainer's step on Qwen2.5-VL beside it, wrong (the mean of micro-batch means, averaged over the
ranks). Numbers: docs/multimodal.md."""

from __future__ import annotations

from pathlib import Path

import pytest

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    from tests.distributed.launcher import run_workers

    worker = Path(__file__).resolve().parent / "workers" / "weighted_cases.py"
    launch = run_workers(worker, nproc=2, timeout=300, out_dir=tmp_path_factory.mktemp("weighted"))
    names = ("plain", "one_token_short", "vlm_llava", "vlm_qwen2_5_vl", "vlm_qwen2_5_vl_stock")
    out = {name: launch.load(name) for name in names}
    for name, ranks in out.items():
        for r, payload in enumerate(ranks):
            if "error" in payload:
                pytest.fail(f"{name}: rank {r} failed:\n{payload['error']}", pytrace=False)
    return out


@pytest.mark.distributed
def test_weighted_step_on_two_ranks_is_exact(results):
    for payload in results["plain"]:
        assert payload["dp_world_size"] == 2 and payload["global_step"] == 1
        assert payload["relative_error"] <= TOLERANCE, payload
        assert payload["max_abs_diff_vs_rank0"] == 0.0  # the replicas agree


@pytest.mark.distributed
def test_one_token_missing_from_one_ranks_weight_sum_fails(results):
    for payload in results["one_token_short"]:
        assert payload["relative_error"] > 10 * TOLERANCE, payload


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["vlm_llava", "vlm_qwen2_5_vl"])
def test_vision_language_step_on_two_ranks_is_exact(results, case):
    for payload in results[case]:
        assert payload["dp_world_size"] == 2 and payload["global_step"] == 1
        assert payload["relative_error"] <= TOLERANCE, payload
        assert payload["max_abs_diff_vs_rank0"] == 0.0
        assert payload["image_path_trained"], payload  # the vision tower got a gradient
    assert results["vlm_qwen2_5_vl"][0]["accepts_loss_kwargs"] is False  # the case the stock Trainer gets wrong


@pytest.mark.distributed
def test_stock_trainer_is_wrong_on_qwen2_5_vl_on_two_ranks(results):
    """Same step, stock Trainer: each micro-batch its own mean (measured: docs/multimodal.md)."""
    for payload in results["vlm_qwen2_5_vl_stock"]:
        assert payload["dp_world_size"] == 2 and payload["global_step"] == 1
        assert payload["relative_error"] > 0.1 and payload["cosine"] < 0.95, payload
