"""`hf-gradacc check` under context parallelism (accelerate ``cp_size``, FSDP2), in one process: what the launch's
config says, the refusal on CPU ranks without a sharding rule for SDPA (through the command, as a user meets it), the
options refused, the collator's padding to ``2 x cp_size`` and the heads refused by name (the run on 2 ranks, with the
test-only attention stand-in: tests/distributed/test_context_parallel.py; on GPUs: tests/gpu/test_context_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

from hf_gradacc.commands.check import check_command
from hf_gradacc.commands.check.cp_rows import (
    ContextParallelCollator,
    check_context_parallel_options,
    context_parallel_size,
    context_parallel_trainer,
    cpu_attention_can_be_sharded,
)
from hf_gradacc.commands.check.mesh_rows import data_ranks, mesh_collator
from hf_gradacc.commands.hf_gradacc_cli import build_parser
from hf_gradacc.errors import GradAccConfigError, UnsupportedBackendError
from hf_gradacc.testing.tiny import IGNORE_INDEX, PaddingCollator, build_tiny_model, make_samples

CLI = build_parser()  # the `hf-gradacc` parser a user's command line goes through
CP2 = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"}


def test_the_context_parallel_size_comes_from_the_accelerate_launch():
    assert context_parallel_size(CP2) == 2 and context_parallel_size({**CP2, "PARALLELISM_CONFIG_CP_SIZE": "1"}) == 1
    assert context_parallel_size({"PARALLELISM_CONFIG_CP_SIZE": "2"}) == 1 and context_parallel_size({}) == 1
    # the cp ranks hold chunks of the same samples: one data rank per cp group
    assert data_ranks(None, 2, CP2) == 1 and data_ranks(None, 4, CP2) == 2 and data_ranks(None, 4, {}) == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU ranks; on GPUs the check runs")
def test_on_cpu_ranks_the_check_is_refused_by_name_before_anything_runs(monkeypatch, capsys):
    """torch 2.13 has no CPU sharding rule for SDPA: without the tests' stand-in the launch used to end in torch's
    NotImplementedError on every rank; now an error of ours, naming why and the GPU tier, and the usage exit status."""
    assert not cpu_attention_can_be_sharded()
    for key, value in CP2.items():
        monkeypatch.setenv(key, value)
    assert check_command(CLI.parse_args(["check", "--task", "causal_lm"])) == 2
    printed = " ".join(capsys.readouterr().err.split())
    assert "under context parallelism (`parallelism_config_cp_size: 2`" in printed, printed
    assert "_scaled_dot_product_flash_attention_for_cpu" in printed and "tests/gpu/test_context_parallel.py" in printed


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--trainer", "sft"], "--trainer sft"),
        (["--scenario", "moe_mixtral"], "--scenario moe_mixtral"),
        (["--distributed_config", "tp_size=2"], "--distributed_config"),
        (["--plot", "x.png"], "--plot"),
    ],
)
def test_options_it_cannot_run_under_context_parallelism_are_refused_by_name(argv, flag):
    with pytest.raises(GradAccConfigError, match=rf"`{flag}` is not supported under context parallelism"):
        check_context_parallel_options(CLI.parse_args(["check", *argv]), 2, on_gpu=True)
    check_context_parallel_options(CLI.parse_args(["check"]), 2, on_gpu=True)  # the default run
    check_context_parallel_options(
        CLI.parse_args(["check"]), 2, on_gpu=False, cpu_attention=True
    )  # on CPU with a stand-in


def test_every_micro_batch_is_right_padded_to_a_multiple_of_2_x_cp_size(monkeypatch):
    samples = make_samples("causal_lm", 3, seed=1)
    base = PaddingCollator()(samples)
    for key, value in CP2.items():
        monkeypatch.setenv(key, value)
    collator = mesh_collator(PaddingCollator(), samples)
    assert isinstance(collator, ContextParallelCollator)
    for cp_size in (2, 3):
        batch = ContextParallelCollator(PaddingCollator(), cp_size=cp_size)(samples)
        width, extra = batch["input_ids"].shape[1], batch["input_ids"].shape[1] - base["input_ids"].shape[1]
        assert width % (2 * cp_size) == 0 and 0 < extra < 2 * cp_size, (cp_size, width)  # 21 wide before
        assert torch.equal(batch["input_ids"][:, : width - extra], base["input_ids"])
        assert (batch["labels"][:, width - extra :] == IGNORE_INDEX).all()
        assert (batch["attention_mask"][:, width - extra :] == 0).all() and batch["attention_mask"].sum() == base[
            "attention_mask"
        ].sum()
    rows = make_samples("sequence_classification", 2, seed=1)  # a label per row is left as it is
    assert ContextParallelCollator(PaddingCollator(), cp_size=2)(rows)["labels"].dim() == 1


def test_heads_other_than_a_causal_lm_are_refused_by_name():
    from transformers import Trainer

    stock = context_parallel_trainer(Trainer, 2)
    assert stock.__name__ == "Trainer"
    with pytest.raises(UnsupportedBackendError, match=r"BertForSequenceClassification \(head `sequence_classification`\)"
                       r" cannot train under context parallelism \(`parallelism_config.cp_size` 2\)"):  # fmt: skip
        stock(model=build_tiny_model("sequence_classification"))
