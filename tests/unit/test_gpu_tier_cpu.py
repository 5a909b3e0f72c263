"""The GPU tier's CPU fallback (``benchmarks/gpu.py --tier --cpu-fallback``): every section's code runs at a tiny scale
on the CPU, so that the command a GPU session runs in one call cannot rot. One run (in this process) feeds every
test; each test reads its section of the JSON and checks numbers, not only that it ran."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the four sections: ~25 s of CPU

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    out = tmp_path_factory.mktemp("tier")
    gpu = _load("gpu")
    code = gpu.main(["--tier", "--cpu-fallback", "--in-process", "--out", str(out)])
    report = json.loads((out / "gpu_tier.json").read_text())
    return code, report, out


def test_every_section_ran_and_the_files_are_written(tier) -> None:
    code, report, out = tier
    sections = report["sections"]
    assert list(sections) == ["exactness", "device_reads", "step_time", "lm_head"]
    assert {name: r["status"] for name, r in sections.items()} == dict.fromkeys(sections, "ok")
    assert code == 0 and report["all_held"] and report["cpu_fallback"]
    for name in sections:
        assert json.loads((out / "sections" / f"{name}.json").read_text())["status"] == "ok"
    text = (out / "gpu_tier.md").read_text()
    for heading in ("## a. exactness", "## b. device reads", "## c. step time", "## d. LM head"):
        assert heading in text


def test_exactness_fp32_is_exact_and_bf16_keeps_the_norm(tier) -> None:
    """float32 within 1e-5 of the float64 reference; bf16 autocast (on CPU) within 5e-3 of the float32 norm."""
    rows = tier[1]["sections"]["exactness"]["rows"]
    assert [r["task"] for r in rows] == ["causal_lm", "seq2seq", "masked_lm", "token_classification",
                                         "sequence_classification", "image_classification"]  # fmt: skip
    for r in rows:
        assert r["status"] == "ok", r
        assert r["fp32_vs_float64"]["relative_error"] <= 1e-5, r
        assert abs(r["bf16_vs_fp32"]["norm_ratio"] - 1.0) <= 5e-3, r
        assert r["bf16_vs_fp32"]["cosine"] >= 0.999, r
        assert 1e-4 < r["bf16_vs_fp32"]["relative_error"] < 5e-2, r  # bf16 did round: the two runs differ
    assert tier[1]["sections"]["exactness"]["bands_held"]


def test_device_reads_are_counted_per_step(tier) -> None:
    section = tier[1]["sections"]["device_reads"]
    rows = {r["trainer"]: r for r in section["rows"]}
    assert set(rows) == {"stock", "gradacc", "gradacc_fused"}
    for r in rows.values():
        assert r["status"] == "ok" and r["steps"] == 2
        assert r["sync_warnings_per_step"] is None  # no CUDA here
        assert all(isinstance(n, int) and n > 0 for n in r["host_reads_per_step"]), r
        assert r["host_reads_steady"] == r["host_reads_per_step"][1]
        assert sum(r["host_reads_by_name"].values()) >= sum(r["host_reads_per_step"])  # and those before step 1
        assert r["host_read_lines_top"], r


def test_step_time_has_a_ratio_per_ga(tier) -> None:
    section = tier[1]["sections"]["step_time"]
    rows = section["rows"]
    assert [(r["ga"], r["trainer"]) for r in rows] == [
        (ga, t) for ga in (1, 4, 8) for t in ("stock", "gradacc", "gradacc_fused")
    ]
    stock = {r["ga"]: r["step_ms_median"] for r in rows if r["trainer"] == "stock"}
    for r in rows:
        assert r["status"] == "ok" and len(r["step_ms"]) == 2 and r["step_ms_median"] > 0, r
        assert r["ratio_vs_stock"] == pytest.approx(r["step_ms_median"] / stock[r["ga"]]), r
    assert section["parameters"] > 0


def test_lm_head_fused_matches_the_full_logits(tier) -> None:
    """float32 on CPU, against float64: the full logits and hf_gradacc's fused head within 1e-5 on the loss and both
    gradients, at every shape; the optional packages are reported, not failed."""
    section = tier[1]["sections"]["lm_head"]
    rows = section["rows"]
    cases = {(r["hidden"], r["vocab"], r["tokens"]) for r in rows}
    assert cases == {(h, v, t) for h, v in ((64, 512), (48, 768), (32, 1000)) for t in (64, 128)}
    for r in rows:
        if r["method"] in ("full_logits", "hf_gradacc_fused", "torch_linear_cross_entropy"):
            assert r["status"] == "ok", r
            assert max(r["loss_rel_err"], r["grad_hidden_rel_err"], r["grad_weight_rel_err"]) <= 1e-5, r
            assert r["ms_median"] > 0 and r["time_vs_full_logits"] > 0, r
        else:  # liger, cce, cce_exact: not installed here, or installed without CUDA
            assert r["status"] == "not installed" or r["status"].startswith("needs CUDA"), r
    assert section["methods"]["hf_gradacc_fused"].endswith("fused_cross_entropy_sum")


def test_a_section_stopped_at_its_hard_limit_keeps_its_rows(tmp_path, monkeypatch) -> None:
    """The driver runs each section in a process of its own: one stopped at its hard limit is recorded as such, with
    the rows it wrote; the process really is stopped (a sleeping child, 0.5 s limit)."""
    tier_module = _load("gpu_tier")
    code, wall = tier_module._worker([sys.executable, "-c", "import time; time.sleep(30)"], 0.5, {})
    assert code is None and wall < 10

    def stopped(cmd, timeout, env):
        name = cmd[cmd.index("--worker") + 1]
        (tmp_path / "sections").mkdir(exist_ok=True)
        partial = {"section": name, "status": "running", "rows": [{"status": "ok"}]}
        (tmp_path / "sections" / f"{name}.json").write_text(json.dumps(partial))
        return None, timeout

    monkeypatch.setattr(tier_module, "_worker", stopped)
    results = tier_module.run_all(["lm_head"], tier_module.CPU, tmp_path, in_process=False, total_s=60,
                                  cpu_fallback=True)  # fmt: skip
    record = results["lm_head"]
    assert record["status"].startswith("stopped at the hard limit") and record["rows"] == [{"status": "ok"}]
    assert not tier_module.verdict(record)


def test_without_cuda_the_tier_stops_with_exit_code_2(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert _load("gpu").main(["--tier", "--out", "/nonexistent/never-written"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
