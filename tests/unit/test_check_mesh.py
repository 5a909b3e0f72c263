"""`hf-gradacc check --distributed_config`: the option's parsing, the data ranks a step covers, the rows of the
default run, and the options it refuses (one process; the runs on 4 and 2 ranks are in
tests/distributed/test_mesh_tp.py and test_mesh_ep.py)."""

from __future__ import annotations

import argparse

import pytest

from hf_gradacc.commands.check import check_command
from hf_gradacc.commands.check.mesh_rows import check_options, data_ranks, head_cases, parse_distributed_config
from hf_gradacc.commands.check.scenarios import HEAD_CASES
from hf_gradacc.commands.hf_gradacc_cli import build_parser
from hf_gradacc.errors import GradAccConfigError

CLI = build_parser()  # the `hf-gradacc` parser a user's command line goes through


def test_parse_distributed_config():
    assert parse_distributed_config("tp_size=2,fsdp_size=2") == {"tp_size": 2, "fsdp_size": 2}
    assert parse_distributed_config(" fsdp_size=2 , ep_size=2 ") == {"fsdp_size": 2, "ep_size": 2}
    for bad in ("", "tp=2", "tp_size=0", "tp_size", "pp_size=2", "tp_size=two"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=N"):
            parse_distributed_config(bad)
    assert CLI.parse_args(["check", "--distributed_config", "tp_size=2"]).distributed_config == {"tp_size": 2}


def test_data_ranks_leave_out_the_tensor_and_expert_ranks():
    assert data_ranks(None, 4) == 4
    assert data_ranks({"tp_size": 2, "fsdp_size": 2}, 4) == 2
    assert data_ranks({"tp_size": 2}, 2) == 1
    assert data_ranks({"fsdp_size": 2, "ep_size": 2}, 2) == 2
    assert data_ranks({"tp_size": 2, "fsdp_size": 2, "dp_replicate_size": 2}, 8) == 4


def test_the_mixtures_of_experts_are_rows_only_under_expert_parallelism():
    assert head_cases(None) == HEAD_CASES == head_cases({"tp_size": 2, "fsdp_size": 2})
    extra = head_cases({"fsdp_size": 2, "ep_size": 2})[len(HEAD_CASES) :]
    assert [(c.key, c.scenario, c.options) for c in extra] == [
        ("moe_mixtral", "moe_mixtral", "--scenario moe_mixtral"),
        ("moe_qwen3", "moe_qwen3", "--scenario moe_qwen3"),
    ]


@pytest.mark.parametrize("extra", [["--plot", "x.png"], ["--model", "some/checkpoint"], ["--trainer", "sft"]])
def test_options_it_cannot_combine_with_are_refused(extra, capsys):
    assert check_command(CLI.parse_args(["check", "--distributed_config", "tp_size=2", *extra])) == 2
    assert "is not supported with `--distributed_config`" in capsys.readouterr().err


def test_a_sequence_parallel_launch_runs_and_refuses_what_it_cannot_run():
    """Under `accelerate launch` with `parallelism_config_sp_size: 2` the check runs (tests/unit/test_check_sp.py, and on
    2 ranks tests/distributed/test_sequence_parallel.py); only the options it cannot run there are refused."""
    sp2 = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"}
    check_options(CLI.parse_args(["check"]), sp2)
    with pytest.raises(GradAccConfigError, match=r"`--plot` is not supported under sequence parallelism.*sp_size: 2"):
        check_options(CLI.parse_args(["check", "--plot", "x.png"]), sp2)
    assert data_ranks(None, 2, sp2) == 1 and data_ranks(None, 2, {}) == 2
