"""The axolotl plugin, with REAL `axolotl train` runs (subprocesses, CPU, a tiny local Llama, no Hub).

Each run is ONE SGD step (lr 1, no clipping, no warm-up, no weight decay) over every sample of a local JSONL file;
the update is read from the saved model against the initial checkpoint. The reference is the same run at
``micro_batch_size: 8, gradient_accumulation_steps: 1`` (one micro-batch: the full batch, exact in stock axolotl);
the plugin at ``micro_batch_size: 2, gradient_accumulation_steps: 4`` must equal it within 1e-5 (relative), and
stock axolotl at 2 x 4 must not (> 1e-3), so each test can fail. Samples of unequal lengths and unequal trained
tokens (prompts not trained on: ``-100`` labels), reward pairs of unequal lengths, 7 pairs (micro-batches 2+2+2+1).

The real runs (marked ``axolotl``) are skipped without axolotl (``pip install axolotl==0.19.0`` beside
``torch==2.13.0``, see docs/axolotl.md). Nine runs of about 20 s of CPU each (most of it importing the axolotl stack):
3 min of CPU on 2 cores (measured 2026-11-25). The in-process tests of the plugin's configuration checks, its
collator wrapper and its class swap need no axolotl (:mod:`hf_gradacc.integrations.axolotl_core`) and always run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import TrainingArguments

from hf_gradacc import GradAccConfigError
from hf_gradacc.integrations import axolotl_core
from hf_gradacc.testing.tiny import VOCAB_SIZE
from hf_gradacc.testing.trl_steps import word, word_tokenizer

HAS_AXOLOTL = importlib.util.find_spec("axolotl") is not None
# the tests that run axolotl itself: marked `axolotl`, and skipped where it is not installed
needs_axolotl = pytest.mark.skipif(not HAS_AXOLOTL, reason="axolotl is not installed (pip install axolotl==0.19.0)")

PLUGIN = "hf_gradacc.integrations.axolotl.GradAccPlugin"
ACTIVE = "hf_gradacc: exact gradient accumulation is active on axolotl's"
EXACT_RTOL = 1e-5
STOCK_MIN_ERROR = 1e-3
ONE_SGD_STEP: dict[str, Any] = {
    "val_set_size": 0,
    "num_epochs": 1,
    "max_steps": 1,
    "optimizer": "sgd",
    "learning_rate": 1.0,
    "lr_scheduler": "constant",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "max_grad_norm": 0,
    "bf16": False,
    "fp16": False,
    "tf32": False,
    "save_strategy": "no",
    "seed": 0,
    "dataset_num_proc": 1,
}
FULL_BATCH = {"micro_batch_size": 8, "gradient_accumulation_steps": 1}
ACCUMULATED = {"micro_batch_size": 2, "gradient_accumulation_steps": 4}


# ---------------------------------------------------------------------------------------------- fixtures
def _tiny_llama(path: Path, *, reward: bool) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        tie_word_embeddings=False, num_labels=1,
    )  # fmt: skip
    (LlamaForSequenceClassification if reward else LlamaForCausalLM)(config).save_pretrained(path)
    word_tokenizer(VOCAB_SIZE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def causal(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny Llama causal LM and 8 pre-tokenized completion samples (7-14 tokens, 2-5 trained on, then EOS)."""
    root = tmp_path_factory.mktemp("axolotl_causal")
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as f:
        for _ in range(8):
            prompt, completion = rng.randint(1, 12), rng.randint(1, 6)
            ids = [rng.randint(3, VOCAB_SIZE - 1) for _ in range(prompt + completion)] + [1]
            row = {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] * prompt + ids[prompt:]}
            f.write(json.dumps(row) + "\n")
    config = {
        "base_model": str(_tiny_llama(root / "model", reward=False)),
        "datasets": [{"path": str(root / "data.jsonl"), "ds_type": "json", "type": None}],
        "dataset_prepared_path": str(root / "prepared"),
        "sequence_len": 64,
        "train_on_inputs": False,
        **ONE_SGD_STEP,
    }
    return {"root": root, "config": config, "runs": {}}


@pytest.fixture(scope="module")
def reward(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny Llama with a one-logit score head and 7 chosen / rejected pairs (axolotl's Bradley-Terry format)."""
    root = tmp_path_factory.mktemp("axolotl_reward")
    rng = random.Random(1)

    def words(n: int) -> str:
        return " ".join(word(rng.randint(3, VOCAB_SIZE - 1)) for _ in range(n))

    with open(root / "data.jsonl", "w") as f:
        for _ in range(7):
            pair = {"system": "", "input": words(rng.randint(1, 8)), "chosen": words(rng.randint(1, 6))}
            f.write(json.dumps({**pair, "rejected": words(rng.randint(1, 6))}) + "\n")
    config = {
        "base_model": str(_tiny_llama(root / "model", reward=True)),
        "model_type": "AutoModelForSequenceClassification",
        "num_labels": 1,
        "reward_model": True,
        "chat_template": "chatml",
        "datasets": [{"path": str(root / "data.jsonl"), "ds_type": "json", "type": "bradley_terry.chat_template"}],
        "dataset_prepared_path": str(root / "prepared"),
        "sequence_len": 64,
        **ONE_SGD_STEP,
    }
    return {"root": root, "config": config, "runs": {}}


def _train(setup: dict[str, Any], name: str, **overrides: Any) -> tuple[torch.Tensor, str]:
    """`axolotl train` on the setup's config with ``overrides``, once per name: the update of every parameter
    (flattened, float64) and the run's output."""
    if name in setup["runs"]:
        return setup["runs"][name]
    root = setup["root"]
    out = root / name
    config = {**setup["config"], **overrides, "output_dir": str(out)}
    (root / f"{name}.yml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "AXOLOTL_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, "-m", "axolotl.cli.main", "train", str(root / f"{name}.yml"), "--launcher", "python"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"axolotl train ({name}) failed:\n{output[-6000:]}"
    before = load_file(Path(config["base_model"]) / "model.safetensors")
    after = load_file(out / "model.safetensors")
    update = torch.cat([(after[k].double() - before[k].double()).flatten() for k in sorted(before)])
    setup["runs"][name] = update, output
    return update, output


def _relative(update: torch.Tensor, reference: torch.Tensor) -> float:
    return float((update - reference).norm() / reference.norm())


def _every_parameter_changed(setup: dict[str, Any], name: str) -> None:
    before = load_file(Path(setup["config"]["base_model"]) / "model.safetensors")
    after = load_file(setup["root"] / name / "model.safetensors")
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, f"parameters not updated: {unchanged}"


# ---------------------------------------------------------------------------------------------- real runs
@pytest.mark.axolotl
@pytest.mark.slow
@needs_axolotl
def test_causal_lm_accumulated_step_equals_the_full_batch_step(causal: dict[str, Any]) -> None:
    reference, _ = _train(causal, "full_batch", **FULL_BATCH)
    stock, _ = _train(causal, "stock_ga4", **ACCUMULATED)
    exact, output = _train(causal, "plugin_ga4", **ACCUMULATED, plugins=[PLUGIN])

    assert _relative(stock, reference) > STOCK_MIN_ERROR  # stock axolotl: the mean of micro-batch means
    assert _relative(exact, reference) < EXACT_RTOL
    _every_parameter_changed(causal, "plugin_ga4")
    assert output.count(ACTIVE) == 1, output[-4000:]
    assert f"{ACTIVE} AxolotlTrainer (now GradAccAxolotlTrainer)" in output
    assert "replaced these transformers.Trainer methods" not in output  # axolotl's own patches are recognised


@pytest.mark.axolotl
@pytest.mark.slow
@needs_axolotl
def test_packed_accumulated_step_equals_the_unpacked_full_batch_step(causal: dict[str, Any]) -> None:
    """Multipack (sdpa: block-diagonal mask from the restarting position_ids), rows of at most 32 tokens, 2 rows per
    micro-batch, 2 micro-batches: the 8 samples in 4 packed rows equal the 8 samples padded in one micro-batch."""
    reference, _ = _train(causal, "full_batch", **FULL_BATCH)
    packed = {"sample_packing": True, "attn_implementation": "sdpa", "sequence_len": 32}
    exact, output = _train(
        causal, "plugin_packed", micro_batch_size=2, gradient_accumulation_steps=2, plugins=[PLUGIN], **packed
    )
    assert _relative(exact, reference) < EXACT_RTOL
    assert "packed rows: the label at each sample start is ignored" in output


@pytest.mark.axolotl
@pytest.mark.slow
@needs_axolotl
def test_reward_model_accumulated_step_equals_the_full_batch_step(reward: dict[str, Any]) -> None:
    reference, _ = _train(reward, "full_batch", **FULL_BATCH)
    stock, _ = _train(reward, "stock_ga4", **ACCUMULATED)
    exact, output = _train(reward, "plugin_ga4", **ACCUMULATED, plugins=[PLUGIN])

    assert _relative(stock, reference) > STOCK_MIN_ERROR  # TRL's per-micro-batch mean: the 1-pair batch weighs 1/4
    assert _relative(exact, reference) < EXACT_RTOL
    _every_parameter_changed(reward, "plugin_ga4")
    assert f"{ACTIVE} AxolotlRewardTrainer (now GradAccAxolotlRewardTrainer)" in output


@pytest.mark.axolotl
@pytest.mark.slow
@needs_axolotl
def test_dpo_accumulated_step_equals_the_full_batch_step(causal: dict[str, Any], tmp_path: Path) -> None:
    """`rl: dpo` (axolotl's DPO trainer, made hf_gradacc.trl's): 7 prompt / chosen / rejected text pairs."""
    rng = random.Random(2)

    def words(n: int) -> str:
        return " ".join(word(rng.randint(3, VOCAB_SIZE - 1)) for _ in range(n))

    with open(tmp_path / "pairs.jsonl", "w") as f:
        for _ in range(7):
            pair = {"prompt": words(rng.randint(1, 8)), "chosen": " " + words(rng.randint(1, 6))}
            f.write(json.dumps({**pair, "rejected": " " + words(rng.randint(1, 6))}) + "\n")
    config = {
        **causal["config"],
        "rl": "dpo",
        "datasets": [
            {"path": str(tmp_path / "pairs.jsonl"), "ds_type": "json", "split": "train", "type": "passthrough"}
        ],
        "dataset_prepared_path": str(tmp_path / "prepared"),
    }
    config.pop("train_on_inputs")
    dpo = {"root": tmp_path, "config": config, "runs": {}}
    reference, _ = _train(dpo, "full_batch", **FULL_BATCH)
    exact, output = _train(dpo, "plugin_ga4", **ACCUMULATED, plugins=[PLUGIN])

    assert _relative(exact, reference) < EXACT_RTOL  # stock axolotl: 0.29 on these pairs (2026-11-25)
    assert f"{ACTIVE} AxolotlDPOTrainer (now GradAccAxolotlDPOTrainer)" in output


# ---------------------------------------------------------------------------------------------- in process
@pytest.mark.parametrize(
    ("config", "knobs", "message"),
    [
        ({"sample_packing": True, "attn_implementation": None, "attn_decontaminates_packing": False}, {},
         "does not keep packed samples apart"),
        ({"sample_packing": True, "attn_decontaminates_packing": True, "reward_model": True}, {},
         "`reward_model: True`"),
        ({"sample_packing": True, "attn_decontaminates_packing": True, "rl": "dpo"}, {}, "`rl: dpo`"),
        ({"sample_packing": True, "attn_decontaminates_packing": True}, {"regroup_micro_batches": True},
         "two planners"),
        ({"context_parallel_size": 2}, {}, "`context_parallel_size: 2`"),
        ({"micro_batch_size": 2, "world_size": 2}, {"total_train_batch_size": 16},
         "`gradacc: {total_train_batch_size: 16}` is not supported by hf_gradacc's axolotl plugin"),
        ({"micro_batch_size": 2, "world_size": 2}, {"total_train_batch_size": 16},
         "`micro_batch_size` and `gradient_accumulation_steps` = total / (`micro_batch_size` x processes) (here 16 "
         "// (2 x 2) = 4)"),
        ({"micro_batch_size": 2}, {"total_train_batch_size": 3}, "`gradient_accumulation_steps` = total / (`micro_batch_size` x "
         "processes)."),
    ],
)  # fmt: skip
def test_refused_setups_name_the_key(config: dict, knobs: dict, message: str) -> None:
    with pytest.raises(GradAccConfigError, match=re.escape(message)):
        axolotl_core.check_axolotl_config(config, knobs)


def test_supported_setups_pass() -> None:
    axolotl_core.check_axolotl_config({}, {})
    axolotl_core.check_axolotl_config({"sample_packing": True, "attn_decontaminates_packing": True}, {})
    axolotl_core.check_axolotl_config({"reward_model": True}, {"regroup_micro_batches": True})


def test_yaml_knobs_are_validated() -> None:
    args = axolotl_core.GradAccAxolotlArgs(gradacc={"nonfinite_steps": "skip"})
    assert args.gradacc == {"nonfinite_steps": "skip"}
    assert axolotl_core.GradAccAxolotlArgs().gradacc is None
    with pytest.raises(ValueError, match="`gradacc` has an unknown field `regroup_microbatches` \\(did you mean "
                       "`regroup_micro_batches`\\?\\); hf_gradacc's knobs are: head_type, "):  # fmt: skip
        axolotl_core.GradAccAxolotlArgs(gradacc={"regroup_microbatches": True})
    with pytest.raises(ValueError, match="nonfinite_steps"):
        axolotl_core.GradAccAxolotlArgs(gradacc={"nonfinite_steps": "sometimes"})


def test_sample_start_labels_are_ignored() -> None:
    def collator(features: Any) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
            "labels": torch.tensor([[5, 6, 7, 8, 9]]),
            "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
        }

    collator.tokenizer = "tok"  # type: ignore[attr-defined]
    wrapped = axolotl_core.SampleStartMasked(collator)
    assert wrapped([])["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert wrapped.tokenizer == "tok"
    unpacked = axolotl_core.SampleStartMasked(lambda f: {"labels": torch.tensor([[5, 6]])})
    assert unpacked([])["labels"].tolist() == [[5, 6]]


def _recorder(entered: list[str], name: str) -> Any:
    @contextlib.contextmanager
    def context() -> Any:
        entered.append(f"enter {name}")
        yield
        entered.append(f"exit {name}")

    return context()


def test_step_contexts_are_entered_around_each_micro_batch_outermost_first() -> None:
    entered: list[str] = []

    class Base:
        def training_step_context(self) -> Any:
            return _recorder(entered, "inner")

    made = axolotl_core._with_step_contexts(Base, ("_layer_offload_ctx", "activation_offload_context"))
    trainer = made()
    trainer._layer_offload_ctx = _recorder(entered, "layer")
    trainer.activation_offload_context = _recorder(entered, "activation")
    with trainer.training_step_context():
        entered.append("step")
    assert entered == [
        "enter layer", "enter activation", "enter inner", "step", "exit inner", "exit activation", "exit layer",
    ]  # fmt: skip


@pytest.mark.axolotl
@needs_axolotl
def test_axolotl_step_wrappers_become_step_contexts() -> None:
    """AxolotlTrainer's `training_step` only wraps the stock one in two contexts: the class handed to make_exact has
    the stock `training_step`, and the contexts are the two axolotl keeps on the instance, outermost first."""
    from axolotl.core.trainers.base import AxolotlTrainer
    from transformers import Trainer

    unwrapped, contexts = axolotl_core._without_step_wrappers(AxolotlTrainer)
    assert unwrapped.training_step is Trainer.training_step and issubclass(unwrapped, AxolotlTrainer)
    assert contexts == ["_layer_offload_ctx", "activation_offload_context"]


def _replaced_by(module: str, original: Any) -> Any:
    @functools.wraps(original)  # the same parameters, as axolotl's re-executed transformers source has
    def replacement(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    replacement.__module__ = module
    return replacement


def _replacement_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "replaced these transformers.Trainer methods" in r.getMessage()]


@pytest.mark.parametrize("unknown", [None, "compute_loss", "_get_learning_rate"])
def test_axolotls_own_trainer_patches_are_not_warned_about_other_ones_are(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, unknown: str | None
) -> None:
    """axolotl replaces `Trainer._get_learning_rate` and `_maybe_log_save_evaluate` at class level on every run (the
    functions' modules below are axolotl 0.19's): the plugin's class swap names no warning for them; a replacement
    from any other module is still warned about, alone, also of a method axolotl patches too."""
    from transformers import Trainer

    from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

    for name, module in axolotl_core.AXOLOTL_TRAINER_PATCHES.items():
        monkeypatch.setattr(Trainer, name, _replaced_by(module, getattr(Trainer, name)))
    if unknown is not None:
        monkeypatch.setattr(Trainer, unknown, _replaced_by("some_other_library.patches", getattr(Trainer, unknown)))
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    trainer = Trainer(model=build_tiny_model("causal_lm"), args=args, data_collator=PaddingCollator(),
                      train_dataset=ListDataset(make_samples("causal_lm", 4)))  # fmt: skip
    with caplog.at_level(logging.WARNING):
        axolotl_core.make_exact_with_step_contexts(trainer, axolotl_core.AXOLOTL_DEFAULTS)
    warnings = _replacement_warnings(caplog)
    if unknown is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(
            f"Trainer.{unknown} (now from some_other_library.patches): another library replaced"
        ), warnings
