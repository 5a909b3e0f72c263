"""`hf-gradacc check` under DeepSpeed Ulysses sequence parallelism, in one process: what the launch's config says,
the options refused, the collator's one width and ``position_ids``, and the set-up undone between trainers (the run
on 2 ranks is in tests/distributed/test_sequence_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from hf_gradacc.commands.check.mesh_rows import check_options, data_ranks
from hf_gradacc.commands.check.sp_rows import (
    SequenceParallelCollator,
    one_sequence_parallel_set_up,
    sequence_parallel_size,
    step_width,
)
from hf_gradacc.commands.hf_gradacc_cli import build_parser
from hf_gradacc.errors import GradAccConfigError
from hf_gradacc.testing.reference import reference_gradients
from hf_gradacc.testing.tiny import IGNORE_INDEX, PaddingCollator, build_tiny_model, make_samples

CLI = build_parser()  # the `hf-gradacc` parser a user's command line goes through
SP2 = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"}


def test_the_sequence_parallel_size_comes_from_the_accelerate_launch():
    assert sequence_parallel_size(SP2) == 2
    assert sequence_parallel_size({**SP2, "PARALLELISM_CONFIG_SP_SIZE": "1"}) == 1
    # accelerate reads PARALLELISM_CONFIG_* only with ACCELERATE_USE_PARALLELISM_CONFIG=true (a config block)
    assert sequence_parallel_size({"PARALLELISM_CONFIG_SP_SIZE": "2"}) == 1
    assert sequence_parallel_size({}) == 1
    # the sequence ranks hold slices of the same samples: one data rank per sequence group
    assert data_ranks(None, 2, SP2) == 1 and data_ranks(None, 4, SP2) == 2


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--trainer", "sft"], "--trainer sft"),
        (["--scenario", "moe_mixtral"], "--scenario moe_mixtral"),
        (["--scenario", "plain_compute_loss"], "--scenario plain_compute_loss"),
        (["--distributed_config", "tp_size=2"], "--distributed_config"),
        (["--plot", "x.png"], "--plot"),
    ],
)
def test_options_it_cannot_run_under_sequence_parallelism_are_refused_by_name(argv, flag):
    with pytest.raises(GradAccConfigError, match=rf"`{flag}` is not supported under sequence parallelism"):
        check_options(CLI.parse_args(["check", *argv]), SP2)
    check_options(CLI.parse_args(["check"]), SP2)  # the default run


def test_more_than_one_sequence_group_on_cpu_ranks_is_refused_by_name():
    """On 4 CPU ranks (sp 2 x data 2) the stock Trainer's Ulysses loss failed in the second group's backward ("Global
    rank 0 is not part of group": torch's differentiable all_gather scatters from global ranks on gloo)."""
    from hf_gradacc.commands.check.sp_rows import check_sequence_parallel_options

    opts = CLI.parse_args(["check"])
    with pytest.raises(GradAccConfigError, match=r"4 processes .* make 2.*`num_processes: 2`"):
        check_sequence_parallel_options(opts, 2, {**SP2, "WORLD_SIZE": "4"}, on_gpu=False)
    check_sequence_parallel_options(opts, 2, {**SP2, "WORLD_SIZE": "4"}, on_gpu=True)
    check_sequence_parallel_options(opts, 2, {**SP2, "WORLD_SIZE": "2"}, on_gpu=False)


def test_accumulation_steps_must_be_a_multiple_of_sp_size():
    with pytest.raises(
        GradAccConfigError, match=r"`--gradient_accumulation_steps` \(3\) must be a multiple of `sp_size` \(2"
    ):
        check_options(CLI.parse_args(["check", "--gradient_accumulation_steps", "3"]), SP2)
    check_options(CLI.parse_args(["check", "--gradient_accumulation_steps", "6", "--task", "causal_lm"]), SP2)


def test_one_width_a_multiple_of_sp_size_with_position_ids():
    samples = make_samples("causal_lm", 8, seed=0)
    longest = max(len(s["input_ids"]) for s in samples)
    width = step_width(samples, 4)
    assert width % 4 == 0 and longest <= width < longest + 4
    collate = SequenceParallelCollator(PaddingCollator(), width=width, sp_size=4)
    for batch_samples in (samples[:2], samples[2:3], samples[5:8]):  # micro-batches of their own longest rows
        batch = collate(batch_samples)
        assert sorted(batch) == ["input_ids", "labels", "position_ids"]  # Ulysses takes no attention mask
        assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape
        assert batch["input_ids"].shape[1] == width
        assert batch["position_ids"][0].tolist() == list(range(width))
        plain = PaddingCollator()(batch_samples)
        cut = plain["input_ids"].shape[1]
        assert torch.equal(batch["input_ids"][:, :cut], plain["input_ids"])
        assert torch.equal(batch["labels"][:, :cut], plain["labels"])
        assert (batch["labels"][:, cut:] == IGNORE_INDEX).all()  # the padding counts nothing
    with pytest.raises(GradAccConfigError, match="multiple of `sp_size`"):
        SequenceParallelCollator(PaddingCollator(), width=width + 1, sp_size=4)
    with pytest.raises(GradAccConfigError, match="more than the step's width"):
        SequenceParallelCollator(PaddingCollator(), width=4, sp_size=4)(samples)


def test_the_padded_full_batch_is_the_same_reference():
    """Right padding, causal attention, ``position_ids`` instead of the mask: the float64 full batch the check
    compares with is the plain collator's."""
    model = build_tiny_model("causal_lm")
    model.config._attn_implementation = "sdpa"
    samples = make_samples("causal_lm", 6, seed=0)
    plain = reference_gradients(model, samples, "causal_lm", PaddingCollator())
    padded = reference_gradients(
        model,
        samples,
        "causal_lm",
        SequenceParallelCollator(PaddingCollator(), width=step_width(samples, 2) + 8, sp_size=2),
    )
    for name, grad in plain.items():
        torch.testing.assert_close(padded[name], grad, rtol=1e-9, atol=1e-12)


def test_the_set_up_is_undone_for_the_next_trainer():
    """DeepSpeed keeps the sequence-parallel groups in globals and wraps the attention in transformers' global table:
    a second trainer of the same process failed ("sequence parallel group is already initialized") or wrapped the
    wrapper ("query input tensor does not match the required shape")."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    mpu._SEQUENCE_PARALLEL_GROUP = "left by a trainer before"
    with one_sequence_parallel_set_up():
        assert mpu._SEQUENCE_PARALLEL_GROUP is None
        mpu._SEQUENCE_PARALLEL_GROUP = mpu._SEQUENCE_DATA_PARALLEL_GROUP = "this trainer's"
        ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda *a, **k: None  # what register_with_transformers does
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    assert mpu._SEQUENCE_PARALLEL_GROUP is None and mpu._SEQUENCE_DATA_PARALLEL_GROUP is None


def test_the_backend_accepts_the_batch_size_accelerate_writes_under_ulysses():
    """accelerate rewrites DeepSpeed's ``train_batch_size`` per data rank when it prepares an engine under Ulysses
    (``micro x GA x world / sp_size``); the check builds the stock Trainer's backend after that to gather its update,
    which refused it ("`train_batch_size` (8) is not ... 2 x 4 x 2 = 16")."""
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from hf_gradacc.backends.deepspeed import check_deepspeed_config

    args = SimpleNamespace(gradient_accumulation_steps=4, per_device_train_batch_size=2, max_grad_norm=0.0)
    config = {"zero_optimization": {"stage": 2}, "train_batch_size": 8}
    check_deepspeed_config(config, args, 2, sequence_parallel_size=2)
    assert config["train_batch_size"] == 8
    with pytest.raises(GradAccConfigError, match=r"`train_batch_size` \(8\).*2 x 4 x 2 = 16"):
        check_deepspeed_config({"zero_optimization": {"stage": 2}, "train_batch_size": 8}, args, 2)
