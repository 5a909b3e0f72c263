"""The recipes of docs/recipes.md, run as users run them on 2 CPU ranks (gloo).

- FSDP2: ``examples/accelerate_configs/fsdp2_cpu.yaml`` (``fsdp_state_dict_type: FULL_STATE_DICT``) makes
  ``trainer.save_model()`` write a full model that ``from_pretrained`` loads, equal to the model the same run saves
  under DDP (``examples/sft_lora.py --use_peft false``, one SGD step, launched with ``accelerate launch``).
- ZeRO-3: under ``zero3_cpu.yaml`` (``zero3_init_flag: false``) ``from_pretrained`` / ``from_config`` after the
  arguments are parsed partition the model at construction; the model class called directly, or a model loaded
  before the arguments, is whole. Training the partitioned load is exact.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from .launcher import run_accelerate

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "accelerate_configs"
SFT_EXAMPLE = REPO / "examples" / "sft_lora.py"
ZERO3_WORKER = Path(__file__).resolve().parent / "workers" / "zero3_construction.py"
LAUNCH_TIMEOUT_S = 400.0
ONE_SGD_STEP = (
    "--max_steps 1 --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --optim sgd --learning_rate 1 "
    "--lr_scheduler_type constant --max_grad_norm 0 --report_to none --save_strategy no --logging_steps 1 "
    "--disable_tqdm true"
).split()


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    pytest.importorskip("trl")
    from hf_gradacc.testing.trl_steps import save_tiny_checkpoint

    example = _load_sft_example()
    path = Path(tempfile.mkdtemp(prefix="hf_gradacc_recipe_ckpt_")) / "tiny"
    save_tiny_checkpoint(path, [row["prompt"] + " " + row["completion"] for row in example.TOY_DATA])
    return path


def _load_sft_example():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("sft_lora_example", SFT_EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run_sft_example(config: str, checkpoint: Path, *, cpu_distributed: bool) -> tuple[Path, dict]:
    out = Path(tempfile.mkdtemp(prefix=f"hf_gradacc_recipe_{Path(config).stem}_"))
    text = run_accelerate(
        CONFIGS / config,
        SFT_EXAMPLE,
        ["--model_name_or_path", str(checkpoint), "--output_dir", str(out / "run"), "--use_peft", "false",
         "--max_train_samples", "7", "--use_cpu", "true", "--bf16", "false", *ONE_SGD_STEP],
        cpu_distributed=cpu_distributed,
        timeout=LAUNCH_TIMEOUT_S,
        out_dir=out,
    ).output  # fmt: skip
    summaries = [json.loads(line) for line in text.splitlines() if line.startswith('{"steps"')]
    assert len(summaries) == 1, f"expected one summary (rank 0 of one 2-rank run):\n{text[-4000:]}"
    return out / "run", summaries[0]


def test_fsdp2_cpu_config_save_model_writes_the_full_trained_model(checkpoint: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    fsdp2_dir, fsdp2 = _run_sft_example("fsdp2_cpu.yaml", checkpoint, cpu_distributed=True)
    ddp_dir, ddp = _run_sft_example("ddp_cpu.yaml", checkpoint, cpu_distributed=False)
    assert fsdp2["steps"] == ddp["steps"] == 1
    assert fsdp2["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-5)
    assert (fsdp2_dir / "model.safetensors").is_file() and not (fsdp2_dir / "pytorch_model_fsdp_0").exists()
    saved = AutoModelForCausalLM.from_pretrained(fsdp2_dir).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(ddp_dir).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    assert sorted(saved) == sorted(reference) == sorted(initial)
    for name, tensor in saved.items():
        assert tensor.shape == initial[name].shape, name  # whole, not a shard
        assert not torch.equal(tensor, initial[name]), f"{name} was saved untrained"
        assert torch.allclose(tensor, reference[name], rtol=1e-5, atol=1e-7), name


def test_zero3_construction_after_the_arguments() -> None:
    pytest.importorskip("deepspeed")
    out = Path(tempfile.mkdtemp(prefix="hf_gradacc_recipe_zero3_"))
    from hf_gradacc.testing.tiny import build_tiny_model

    tiny = out / "tiny96"  # the vocabulary of hf_gradacc.testing.tiny's samples
    build_tiny_model("causal_lm").save_pretrained(tiny)
    launch = run_accelerate(  # batch 2 x GA 4 (the later flag wins) x 2 ranks
        CONFIGS / "zero3_cpu.yaml",
        ZERO3_WORKER,
        [str(tiny), "--output_dir", str(out / "run"), *ONE_SGD_STEP, "--gradient_accumulation_steps", "4"],
        cpu_distributed=True,
        timeout=LAUNCH_TIMEOUT_S,
        out_dir=out,
    )  # fmt: skip
    for rank, result in enumerate(launch.load("zero3_construction")):
        where = f"rank {rank}: {result}"
        assert result["zero_stage"] == 3 and result["zero3_init_flag"] is False and result["num_processes"] == 2, where
        assert not result["before_parse_from_pretrained"]["partitioned"], where
        assert not result["after_parse_class_from_config"]["partitioned"], where
        for key in ("after_parse_from_pretrained", "after_parse_auto_from_config"):
            assert result[key]["partitioned"] and result[key]["local_numel"] == 0, f"{key}: {where}"
        assert result["relative_error"] <= 1e-5 and result["num_unchanged"] == 0, where
