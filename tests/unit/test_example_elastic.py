"""examples/elastic_clm.py on one process, as every (re)start runs it: the first start trains to checkpoint-2 and
stops (``--max_steps 2``); the next start of the same command with a longer run resumes from the newest complete
checkpoint (a newer folder whose save was killed midway is passed over) and finishes; ``starts.jsonl`` records both.
The torchrun elastic run of the same script is tests/distributed/test_elastic.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_example():
    spec = importlib.util.spec_from_file_location("elastic_example", ROOT / "examples" / "elastic_clm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_each_start_resumes_from_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    module = _load_example()
    common = [
        "--output_dir", str(tmp_path), "--save_steps", "2", "--use_cpu", "true", "--report_to", "none",
        "--disable_tqdm", "true", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
        "--save_on_preemption", "true", "--num_samples", "32",
    ]  # fmt: skip
    first = module.main([*common, "--max_steps", "2"])
    assert first["resumed_from"] is None and first["global_step"] == 2 and not first["preempted"]
    (tmp_path / "checkpoint-3").mkdir()  # a save killed midway: get_last_checkpoint would take it
    second = module.main([*common, "--max_steps", "4"])
    assert second["resumed_from"] == "checkpoint-2" and second["global_step"] == 4
    events = [line for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    assert len(events) == 4 and '"event": "finished"' in events[-1]
