"""examples/resume_with_new_layout.py, unchanged, on one process: run A (batch 2 x GA 2, 24 samples) stops after
its checkpoint at step 2; run B resumes it with GA 4. The recorded sample ids of A's two steps plus B's are every
sample of the epoch exactly once, B's steps hold 8 samples each, and one warning names the change (2 -> 4) and the
sample the run continues from.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUM_SAMPLES = 24


def _load_example():
    spec = importlib.util.spec_from_file_location("resume_example", ROOT / "examples" / "resume_with_new_layout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_resume_with_another_gradient_accumulation_trains_every_sample_once(tmp_path: Path, caplog) -> None:
    module = _load_example()
    common = [
        "--output_dir", str(tmp_path), "--num_samples", str(NUM_SAMPLES), "--per_device_train_batch_size", "2",
        "--num_train_epochs", "1", "--save_steps", "2", "--use_cpu", "true", "--report_to", "none",
        "--disable_tqdm", "true", "--logging_steps", "1",
    ]  # fmt: skip
    first = module.main([*common, "--gradient_accumulation_steps", "2", "--max_steps", "2"])
    assert first["global_step"] == 2 and (tmp_path / "checkpoint-2").is_dir()
    assert [len(ids) for ids in first["steps"].values()] == [4, 4]

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        second = module.main([
            *common, "--gradient_accumulation_steps", "4", "--resume_from_checkpoint", str(tmp_path / "checkpoint-2"),
        ])  # fmt: skip

    steps = second["steps"]
    assert list(steps) == [1, 2, 3, 4]  # A's 2 steps of 4 samples, then the rest (16) in steps of 8
    assert [len(ids) for ids in steps.values()] == [4, 4, 8, 8]
    assert steps[1] == first["steps"][1] and steps[2] == first["steps"][2]
    trained = sorted(i for ids in steps.values() for i in ids)
    assert trained == list(range(NUM_SAMPLES))  # every sample once: none lost, none twice
    assert second["epochs"] == {0: {"missing": [], "more_than_once": [], "once": True}}
    assert second["global_step"] == 4

    messages = [r.getMessage() for r in caplog.records if r.name.startswith("hf_gradacc")]
    resumed = [m for m in messages if m.startswith("Resuming")]
    assert len(resumed) == 1, messages
    assert "gradient_accumulation_steps 2 -> 4" in resumed[0]
    assert "the first 8 samples of epoch 0" in resumed[0] and "continues from sample 8" in resumed[0]
