"""`hf-gradacc check`: the table, the exit status, --json, --model, --plot and usage errors (one process).

Most tests call ``main(argv)`` in-process; one runs ``python -m hf_gradacc check`` as users do. The exactness
bound is the project's: relative gradient error <= 1e-5 against the float64 full-batch reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

from hf_gradacc.commands import _shared
from hf_gradacc.commands import check as check_command
from hf_gradacc.commands import hf_gradacc_cli as cli
from hf_gradacc.commands.check.scenarios import HEAD_CASES, synthetic_samples
from hf_gradacc.commands.hf_gradacc_cli import main
from hf_gradacc.testing.tiny import TASKS

TOLERANCE = 1e-5
REPO_ROOT = Path(__file__).resolve().parents[2]


def _row(output: str, name: str) -> list[str]:
    """The cells of the table row of trainer ``name``."""
    for line in output.splitlines():
        cells = line.split()
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no table row for {name!r} in:\n{output}")


def _save_tiny(path: Path, model_class, **config_kwargs) -> Path:
    """A small BERT / Llama checkpoint written with save_pretrained (no Hub)."""
    torch.manual_seed(0)
    if model_class.__name__.startswith("Llama"):
        config = transformers.LlamaConfig(
            vocab_size=200,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            **config_kwargs,
        )
    else:
        config = transformers.BertConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            **config_kwargs,
        )
    model_class(config).save_pretrained(path)
    return path


def _head_rows(output: str) -> dict[str, list[str]]:
    """The rows of the default run's table by head: [head, stock verdict, stock error, ours verdict, ours error, ...]."""
    keys = {case.key for case in HEAD_CASES}
    return {cells[0]: cells for cells in (line.split() for line in output.splitlines()) if cells and cells[0] in keys}


def test_check_default_shows_every_head_and_exits_0(tmp_path, capsys):
    """The first run a newcomer makes: one row per built-in head, the stock Trainer WRONG on all but the causal LM
    that consumes num_items_in_batch, GradAccTrainer exact (<= 1e-5) on every one."""
    report = tmp_path / "check.json"
    assert main(["check", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "2 per device x 4 accumulation steps x 1 process = 8 samples per step" in out
    assert f"torch {torch.__version__}" in out and f"transformers {transformers.__version__}" in out
    rows = _head_rows(out)
    assert list(rows) == [case.key for case in HEAD_CASES]
    for key, cells in rows.items():
        assert cells[3] == "exact" and float(cells[4]) <= TOLERANCE, cells
        if key != "causal_lm":  # the stock causal LM: exact on transformers >= 5.16, 0.982x on 5.6
            assert cells[1] == "WRONG" and float(cells[2]) > 0.1, cells
    assert rows["sequence_classification"][5:] == ["--task", "sequence_classification", "norm", "4.00x"]
    assert rows["causal_lm_no_loss_kwargs"][5:7] == ["--scenario", "no_loss_kwargs"]
    last = out.strip().splitlines()[-1]
    assert last.startswith(
        f"hf-gradacc check: GradAccTrainer is exact on all {len(HEAD_CASES)} heads (largest rel err "
    )
    num_wrong = sum(cells[1] == "WRONG" for cells in rows.values())
    assert num_wrong >= len(HEAD_CASES) - 1
    assert last.endswith(f"stock Trainer is wrong on {num_wrong} of {len(HEAD_CASES)}")

    data = json.loads(report.read_text())
    assert data["command"] == "check" and data["is_exact"] is True and data["summary"] == last
    assert data["setup"]["num_samples"] == 8 and data["setup"]["world_size"] == 1
    for key, head in data["heads"].items():
        ours, stock = head["results"]["GradAccTrainer"], head["results"]["Trainer"]
        assert ours["is_exact"] is True and ours["relative_error"] <= TOLERANCE, key
        assert stock["is_exact"] is (rows[key][1] == "exact"), key
    assert abs(data["heads"]["sequence_classification"]["results"]["Trainer"]["norm_ratio"] - 4.0) < 1e-3


def test_check_default_exits_1_when_one_head_is_not_exact(capsys):
    assert main(["check", "--tolerance", "1e-15"]) == 1
    out = capsys.readouterr().out
    assert all(cells[3] == "WRONG" for cells in _head_rows(out).values())
    assert out.strip().splitlines()[-1].startswith("hf-gradacc check: GradAccTrainer is NOT exact on causal_lm, ")


def test_check_task_causal_lm_prints_table_and_exits_0(capsys):
    assert main(["check", "--task", "causal_lm"]) == 0
    out = capsys.readouterr().out
    assert "task      causal_lm" in out
    assert "LlamaForCausalLM (built-in tiny model" in out
    assert "2 per device x 4 accumulation steps x 1 process = 8 samples per step" in out
    assert f"torch {torch.__version__}" in out and f"transformers {transformers.__version__}" in out
    ours = _row(out, "GradAccTrainer")
    assert float(ours[1]) <= TOLERANCE and ours[-1] == "exact"
    last = out.strip().splitlines()[-1]
    assert last.startswith("hf-gradacc check: GradAccTrainer is exact (rel err ")
    if Version(transformers.__version__) >= Version("5.16"):
        # Causal LM with a `labels` key is the one case the stock Trainer gets right: the report says so.
        assert _row(out, "Trainer")[-1] == "exact"
        assert "exact here too" in out
        assert last.endswith("stock Trainer is exact too")
    else:  # transformers 5.6 divides the causal LM's loss by another count: the right direction, 0.982x the size
        assert _row(out, "Trainer")[-1] == "WRONG"
        assert "x its size" in out and "router" not in out


def test_check_sequence_classification_json(tmp_path, capsys):
    report = tmp_path / "check.json"
    assert main(["check", "--task", "sequence_classification", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert _row(out, "Trainer")[-1] == "WRONG"
    assert _row(out, "GradAccTrainer")[-1] == "exact"
    assert "stock Trainer is off by 4.0x" in out.strip().splitlines()[-1]

    data = json.loads(report.read_text())
    assert data["command"] == "check" and data["is_exact"] is True and data["tolerance"] == TOLERANCE
    assert data["setup"]["task"] == "sequence_classification"
    assert data["setup"]["world_size"] == 1 and data["setup"]["num_samples"] == 8
    assert data["setup"]["versions"]["transformers"] == transformers.__version__
    ours, stock = data["results"]["GradAccTrainer"], data["results"]["Trainer"]
    assert ours["relative_error"] <= TOLERANCE and ours["is_exact"] is True
    assert abs(ours["norm_ratio"] - 1) < 1e-5 and abs(ours["cosine"] - 1) < 1e-9
    # Each micro-batch's mean counts fully: the stock step is GA = 4 times the full-batch step.
    assert stock["is_exact"] is False and abs(stock["norm_ratio"] - 4.0) < 1e-3
    assert data["summary"] == out.strip().splitlines()[-1]


def test_check_exits_1_when_not_within_tolerance(capsys):
    assert main(["check", "--task", "regression", "--gradient_accumulation_steps", "2", "--tolerance", "1e-15"]) == 1
    out = capsys.readouterr().out
    assert _row(out, "GradAccTrainer")[-1] == "WRONG"
    assert "GradAccTrainer is NOT exact" in out.strip().splitlines()[-1]


def test_check_model_from_save_pretrained_with_dropout(tmp_path, capsys):
    # BERT's default dropout (0.1) is on in the checkpoint: the check must switch it off to compare with the reference.
    path = _save_tiny(tmp_path / "bert-tok", transformers.BertForTokenClassification, num_labels=5)
    assert main(["check", "--model", str(path), "--gradient_accumulation_steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "task      token_classification" in out  # read from `architectures`
    assert f"BertForTokenClassification ({path}" in out
    assert float(_row(out, "GradAccTrainer")[1]) <= TOLERANCE
    assert _row(out, "Trainer")[-1] == "WRONG"


def test_check_model_with_task_override(tmp_path, capsys):
    # A decoder checkpoint without pad_token_id, loaded for sequence classification: a new head, a pad id set.
    path = _save_tiny(tmp_path / "llama", transformers.LlamaForCausalLM)
    status = main(["check", "--model", str(path), "--task", "sequence_classification", "--json", str(tmp_path / "r")])
    assert status == 0
    data = json.loads((tmp_path / "r").read_text())
    assert data["setup"]["model_class"] == "LlamaForSequenceClassification"
    assert data["results"]["GradAccTrainer"]["relative_error"] <= TOLERANCE
    assert abs(data["results"]["Trainer"]["norm_ratio"] - 4.0) < 1e-3
    capsys.readouterr()


@pytest.mark.parametrize("task", ["causal_lm", "seq2seq", "token_classification", "multi_label_classification"])
def test_synthetic_samples_stay_within_model_vocab_and_labels(task):
    config = transformers.BertConfig(vocab_size=9, num_labels=5, pad_token_id=4, max_position_embeddings=16)
    model = torch.nn.Module()
    model.config = config
    samples = synthetic_samples(task, 12, 0, model)
    assert len(samples) == 12
    assert {len(s["input_ids"]) for s in samples} != {len(samples[0]["input_ids"])}  # still mixed lengths
    for s in samples:
        assert all(2 <= i < 9 and i != 4 for i in s["input_ids"])  # never the pad id inside a row
        assert len(s["input_ids"]) <= 14
        labels = s["labels"]
        if task == "multi_label_classification":
            assert len(labels) == 5 and set(labels) <= {0.0, 1.0}
        elif task == "token_classification":
            assert all(x == -100 or 0 <= x < 5 for x in labels)
        else:
            assert all(x == -100 or 2 <= x < 9 for x in labels)
    if task in ("causal_lm", "token_classification"):
        assert any(x == -100 for s in samples for x in s["labels"])  # the prompt masking survives


def test_check_plot_writes_png_and_curves(tmp_path, capsys):
    image, report = tmp_path / "curves.png", tmp_path / "curves.json"
    argv = ["check", "--task", "masked_lm", "--plot", str(image), "--steps", "3", "--json", str(report)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"to {image}" in captured.out
    assert "training " in captured.err  # the progress bar
    data = image.read_bytes()
    assert len(data) > 10_000 and data[:8] == b"\x89PNG\r\n\x1a\n"

    curves = json.loads(report.read_text())["loss_curves"]
    truth = curves["one full batch per step (ground truth)"]["loss"]
    ours = curves["GradAccTrainer, GA 4"]["loss"]
    stock = curves["stock Trainer, GA 4"]["loss"]
    assert len(truth) == len(ours) == len(stock) == 3
    assert ours[0] == stock[0] == pytest.approx(truth[0], abs=1e-6)  # before any step
    assert max(abs(a - b) for a, b in zip(ours, truth)) < 1e-5
    # Masked LM: the stock step points elsewhere (micro-batch means weighted equally), so the run drifts.
    assert max(abs(a - b) for a, b in zip(stock, truth)) > 1e-4
    assert len(curves["GradAccTrainer, GA 4"]["logged_loss"]) == 3


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["check", "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install hf_gradacc[plot]" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_bad_task_is_a_usage_error(capsys):
    assert main(["check", "--task", "summarization"]) == 2
    err = capsys.readouterr().err
    assert "argument --task: invalid choice: 'summarization'" in err
    assert all(task in err for task in TASKS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps: expected an integer >= 1"),
        (["check", "--tolerance", "-1"], "--tolerance: expected a number > 0"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_values_are_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_model_errors_name_the_fix(tmp_path, capsys):
    assert main(["check", "--model", str(tmp_path / "missing")]) == 2
    assert "is a local path that does not exist" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert main(["check", "--model", str(tmp_path / "a-file")]) == 2
    assert "is not a directory" in capsys.readouterr().err

    path = _save_tiny(tmp_path / "no-arch", transformers.BertForMaskedLM)
    config = json.loads((path / "config.json").read_text())
    config.pop("architectures", None)
    (path / "config.json").write_text(json.dumps(config))
    assert main(["check", "--model", str(path)]) == 2
    assert "pass --task" in capsys.readouterr().err


def test_help(capsys):
    assert main(["--help"]) == 0
    assert "check" in capsys.readouterr().out
    assert main(["check", "--help"]) == 0
    out = capsys.readouterr().out
    for option in (
        "--task",
        "--model",
        "--per_device_train_batch_size",
        "--gradient_accumulation_steps",
        "--seed",
        "--tolerance",
        "--json",
        "--plot",
        "--steps",
        "--optimizer",
        "--learning_rate",
        "--verbose",
    ):
        assert option in out
    assert main([]) == 2  # no subcommand


def test_warns_when_accelerate_started_one_process(monkeypatch, capsys):
    for key in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    check_command._warn_if_launch_fell_back_to_one_process()
    assert "running as ONE process" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_command._warn_if_launch_fell_back_to_one_process()
    assert capsys.readouterr().err == ""


def test_python_dash_m(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "hf_gradacc", "check", "--task", "token_classification"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("hf-gradacc check: GradAccTrainer is exact") and "stock Trainer is off" in last
    # Quiet by default: no Trainer log dicts, no DeepSpeed accelerator notice.
    assert "'loss'" not in proc.stdout and "real_accelerator" not in proc.stderr


def test_bench_subcommand_is_wired(capsys):
    from hf_gradacc.commands.hf_gradacc_cli import main

    assert main(["bench", "--help"]) == 0
    assert "--max-tokens" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert "bench" in capsys.readouterr().out


def test_console_main_returns_the_status_without_a_process_group(monkeypatch, capsys):
    # Only after a gloo group does the executable leave through os._exit; a single process returns normally.
    monkeypatch.setattr(sys, "argv", ["hf-gradacc"])
    monkeypatch.setattr(os, "_exit", lambda status: pytest.fail(f"os._exit({status}) without a process group"))
    assert cli.console_main() == cli.EXIT_USAGE
    assert "check" in capsys.readouterr().err


def test_console_main_exits_hard_after_a_gloo_group(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["hf-gradacc"])
    monkeypatch.setattr(_shared, "_GLOO_GROUP_FINISHED", True)
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    cli.console_main()
    assert exits == [cli.EXIT_USAGE]


@pytest.mark.parametrize(
    "error, status",
    [
        ("GradAccConfigError", cli.EXIT_USAGE),  # a setting to change
        ("UnsupportedBackendError", cli.EXIT_USAGE),
        ("GradAccDataError", cli.EXIT_NOT_EXACT),  # the step itself failed
    ],
)
def test_check_exit_status_of_trainer_errors(monkeypatch, capsys, error, status):
    from hf_gradacc import errors
    from hf_gradacc.testing import one_step as check

    def fail(*args, **kwargs):
        raise getattr(errors, error)("`gradient_accumulation_steps` (3) disagrees with the DeepSpeed config (4)")

    monkeypatch.setattr(check, "one_step_update", fail)
    assert main(["check", "--task", "causal_lm"]) == status
    assert "hf-gradacc check: error: `gradient_accumulation_steps` (3)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "error, status, message",
    [
        # every head refused by the set-up: nothing ran, a setting to change
        (
            "GradAccConfigError",
            cli.EXIT_USAGE,
            "error: no built-in head could run under this set-up:\n  causal_lm: GradAccConfigError: `",
        ),
        ("GradAccDataError", cli.EXIT_NOT_EXACT, "error: causal_lm: `gradient_accumulation_steps` (3)"),
    ],
)
def test_check_default_exit_status_of_trainer_errors(monkeypatch, capsys, error, status, message):
    from hf_gradacc import errors
    from hf_gradacc.testing import one_step as check

    def fail(*args, **kwargs):
        raise getattr(errors, error)("`gradient_accumulation_steps` (3) disagrees with the DeepSpeed config (4)")

    monkeypatch.setattr(check, "one_step_update", fail)
    assert main(["check"]) == status
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("error", ["UnsupportedBackendError", "NotImplementedError"])
def test_check_default_skips_a_head_the_set_up_refuses(monkeypatch, capsys, error):
    """A head the backend cannot take is a skipped row with the reason; the others still decide the status. FSDP2
    refuses BERT with hf_gradacc's error and ConvNeXt with accelerate's NotImplementedError (get_input_embeddings)."""
    from hf_gradacc import errors
    from hf_gradacc.testing import one_step as check

    real = check.one_step_update
    exc_class = getattr(errors, error, None) or NotImplementedError

    def refuse_bert(trainer_class, model, *args, **kwargs):
        if type(model).__name__.startswith("Bert"):
            raise exc_class(f"{type(model).__name__} cannot be wrapped here:\nset something")
        return real(trainer_class, model, *args, **kwargs)

    monkeypatch.setattr(check, "one_step_update", refuse_bert)
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    skipped = [line.split() for line in out.splitlines() if " skipped " in line]
    assert skipped and all(cells[1] == "skipped" for cells in skipped), out
    assert f"{error}: BertForMaskedLM cannot be wrapped here: set something" in out
    ran = len(HEAD_CASES) - len(skipped)
    assert f"exact on all {ran} heads that ran ({len(skipped)} skipped)" in out.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------- --trainer sft / dpo
def test_check_trainer_dpo_shows_stock_trl_off_and_exits_0(tmp_path, capsys):
    """7 pairs at batch 2 x GA 4 (2 + 2 + 2 + 1): TRL's DPOTrainer averages micro-batch means, GradAccDPOTrainer is
    the mean over all pairs; both against the float64 reference of hf_gradacc/testing/trl_steps.py."""
    pytest.importorskip("trl")
    report = tmp_path / "check.json"
    assert main(["check", "--trainer", "dpo", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "task      dpo (TRL DPOTrainer)" in out and "= 7 samples per step" in out
    assert "micro-batches of 2, 2, 2, 1 per process" in out
    ours, stock = _row(out, "GradAccDPOTrainer"), _row(out, "DPOTrainer")
    assert float(ours[1]) <= TOLERANCE and ours[-1] == "exact"
    assert float(stock[1]) > 0.2 and stock[-1] == "WRONG"
    assert "the mean of micro-batch means" in " ".join(out.split())  # the note, unwrapped
    assert out.strip().splitlines()[-1].startswith("hf-gradacc check: GradAccDPOTrainer is exact (rel err ")
    data = json.loads(report.read_text())
    assert list(data["results"]) == ["DPOTrainer", "GradAccDPOTrainer"] and data["is_exact"] is True
    assert data["setup"]["num_samples"] == 7 and data["setup"]["task"] == "dpo (TRL DPOTrainer)"


def test_check_trainer_sft_both_exact(capsys):
    """TRL's SFTTrainer already divides by the step's token count: the report says both are exact, and why."""
    pytest.importorskip("trl")
    assert main(["check", "--trainer", "sft", "--gradient_accumulation_steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "micro-batches of 2, 2, 1 per process" in out
    for name in ("SFTTrainer", "GradAccSFTTrainer"):
        row = _row(out, name)
        assert float(row[1]) <= TOLERANCE and row[-1] == "exact", row
    assert "TRL's SFTTrainer is exact here too" in " ".join(out.split())
    assert out.strip().splitlines()[-1].endswith("stock SFTTrainer is exact too")


def test_check_trainer_sft_on_a_saved_causal_lm(tmp_path, capsys):
    """--model with --trainer: the checkpoint is loaded as a causal LM; rows are drawn within its vocabulary (200)."""
    pytest.importorskip("trl")
    path = _save_tiny(tmp_path / "llama", transformers.LlamaForCausalLM)
    assert main(["check", "--trainer", "sft", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM (" in out and str(path) in out
    assert _row(out, "GradAccSFTTrainer")[-1] == "exact"


def test_check_trainer_dpo_with_equal_micro_batches_says_stock_is_exact_there(capsys):
    pytest.importorskip("trl")
    assert main(["check", "--trainer", "dpo", "--per_device_train_batch_size", "1"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "DPOTrainer")[-1] == "exact"
    assert "every micro-batch holds the same number of pairs" in " ".join(out.split())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--task", "masked_lm"], "trains a causal LM; drop `--task masked_lm`"),
        (["--scenario", "moe_mixtral"], "`--scenario moe_mixtral` is for `--trainer trainer`"),
        (["--plot", "curves.png"], "`--plot` draws the loss curves of `--trainer trainer`"),
    ],
)
def test_check_trainer_refuses_options_of_the_plain_check(argv, message, tmp_path, capsys):
    pytest.importorskip("trl")
    pytest.importorskip("matplotlib")
    assert main(["check", "--trainer", "sft", *argv]) == 2
    assert message in capsys.readouterr().err


def test_check_trainer_without_trl_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now fails as if it were not installed
    monkeypatch.delitem(sys.modules, "hf_gradacc.trl", raising=False)
    import hf_gradacc

    monkeypatch.delattr(hf_gradacc, "trl", raising=False)  # `from .. import trl` would find the module imported before
    assert main(["check", "--trainer", "dpo"]) == 2
    assert 'pip install "hf_gradacc[trl]"' in capsys.readouterr().err


def test_the_stock_note_tells_a_wrong_size_from_a_wrong_weighting():
    """transformers 5.6's stock causal-LM step is only too small (right direction); an MoE step's router term is
    weighted wrongly (other direction): the report names the cause each time, the router only for a model with one."""
    from hf_gradacc.commands.check.report import stock_note
    from hf_gradacc.testing.reference import Comparison

    size_only = Comparison(relative_error=1.79e-2, cosine=1.0 - 1e-12, norm_ratio=0.9821)
    assert "0.9821x its size" in stock_note(size_only, 1e-5, "causal_lm")
    weighting = Comparison(relative_error=1.4e-2, cosine=0.99995, norm_ratio=1.001)
    assert "router term" in stock_note(weighting, 1e-5, "causal_lm", has_router=True)
    assert "router" not in stock_note(weighting, 1e-5, "causal_lm")


# ---------------------------------------------------------------------------------------------- a checkpoint's head
def test_check_task_causal_lm_on_a_classification_checkpoint_is_refused(tmp_path, capsys):
    """A BertForSequenceClassification checkpoint with `--task causal_lm`: no silent new LM head, no router story;
    the error names `--task`, the architecture and the way out."""
    path = _save_tiny(tmp_path / "bert-cls", transformers.BertForSequenceClassification, num_labels=3)
    assert main(["check", "--model", str(path), "--task", "causal_lm"]) == 2
    captured = capsys.readouterr()
    assert "hf-gradacc check: error: `--task causal_lm`" in captured.err
    assert "BertForSequenceClassification" in captured.err and "not a causal LM" in captured.err
    assert "Drop `--task`" in captured.err
    assert "router" not in captured.err + captured.out


def test_check_task_other_than_the_checkpoint_head_warns(tmp_path, capsys):
    """Another head than the checkpoint's (BERT classifier as masked LM) runs, with a warning naming both."""
    path = _save_tiny(tmp_path / "bert-cls", transformers.BertForSequenceClassification, num_labels=3)
    assert main(["check", "--model", str(path), "--task", "masked_lm"]) == 0
    captured = capsys.readouterr()
    assert "hf-gradacc check: warning: `--task masked_lm` loads" in captured.err
    assert "BertForSequenceClassification" in captured.err and "randomly initialised masked_lm head" in captured.err
    assert _row(captured.out, "GradAccTrainer")[-1] == "exact"
    assert "router" not in captured.out


def test_check_trainer_on_a_classification_checkpoint_is_refused(tmp_path, capsys):
    pytest.importorskip("trl")
    path = _save_tiny(tmp_path / "bert-cls", transformers.BertForSequenceClassification, num_labels=3)
    assert main(["check", "--trainer", "sft", "--model", str(path)]) == 2
    assert "not a causal LM" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_check_trainer_on_a_saved_moe_includes_the_router_term(tmp_path, capsys, kind):
    """A tiny Mixtral (router coefficient 0.5, output_router_logits on) saved with save_pretrained: the float64
    reference holds the router term, each micro-batch's coef x aux weighted by its share of the step's routed tokens
    (docs/trl.md), so the correct GradAcc trainer is exact and TRL's (router term / GA per micro-batch) is not."""
    pytest.importorskip("trl")
    from hf_gradacc.testing.tiny import build_tiny_moe

    build_tiny_moe("mixtral", router_aux_loss_coef=0.5).save_pretrained(tmp_path / "mixtral")
    report = tmp_path / "check.json"
    assert main(["check", "--trainer", kind, "--model", str(tmp_path / "mixtral"), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "router term on (coefficient 0.5)" in out
    name = kind.upper()
    ours, stock = _row(out, f"GradAcc{name}Trainer"), _row(out, f"{name}Trainer")
    assert float(ours[1]) <= TOLERANCE and ours[-1] == "exact"
    assert float(stock[1]) > 1e-3 and stock[-1] == "WRONG"
    assert json.loads(report.read_text())["results"][f"GradAcc{name}Trainer"]["relative_error"] <= TOLERANCE


def test_the_heads_note_follows_the_causal_lm_row():
    """transformers 5.6's stock causal LM is off too: the default run's note then says so instead of calling the
    causal LM the stock Trainer's exact case."""
    from hf_gradacc.commands.check.report import HeadResult, Setup, format_heads_report
    from hf_gradacc.testing.reference import Comparison

    setup = Setup(task="every built-in head", model="built-in tiny models", model_class="", num_parameters=0,
                  per_device_train_batch_size=2, gradient_accumulation_steps=4, world_size=1, num_samples=8,
                  backend="single process", device="cpu", seed=0, versions={})  # fmt: skip
    exact = Comparison(relative_error=3e-7, cosine=1.0, norm_ratio=1.0)
    small = Comparison(relative_error=1.8e-2, cosine=1.0, norm_ratio=0.982)
    scaled = Comparison(relative_error=3.0, cosine=1.0, norm_ratio=4.0)
    seq = HeadResult(key="sequence_classification", options="--task sequence_classification", task="sequence_classification",
                     stock=scaled, ours=exact)  # fmt: skip
    for stock, phrase in ((exact, "It is exact only when"), (small, "Even the plain causal LM")):
        clm = HeadResult(key="causal_lm", options="--task causal_lm", task="causal_lm", stock=stock, ours=exact)
        text = " ".join(format_heads_report(setup, [clm, seq], 1e-5).split())
        assert phrase in text, text
        assert f"wrong on {1 + (stock is small)} of 2 heads" in text


def test_the_heads_note_names_the_ulysses_loss_under_sequence_parallelism():
    """Under SP the stock causal LM is off through transformers' own Ulysses loss, not num_items_in_batch: the note
    says so there and keeps the transformers 5.6 wording elsewhere."""
    from dataclasses import replace

    from hf_gradacc.commands.check.report import HeadResult, Setup, format_heads_report
    from hf_gradacc.testing.reference import Comparison

    setup = Setup(task="every built-in head", model="built-in tiny models", model_class="", num_parameters=0,
                  per_device_train_batch_size=2, gradient_accumulation_steps=4, world_size=2, num_samples=8,
                  backend="DeepSpeed ZeRO-2", device="cpu", seed=0, versions={})  # fmt: skip
    exact = Comparison(relative_error=3e-7, cosine=1.0, norm_ratio=1.0)
    off = Comparison(relative_error=3.5, cosine=0.574, norm_ratio=3.97)
    clm = HeadResult(key="causal_lm", options="--task causal_lm", task="causal_lm", stock=off, ours=exact)
    sp = " ".join(format_heads_report(replace(setup, mesh="SP 2"), [clm], 1e-5).split())
    assert "Ulysses loss" in sp and "transformers 5.6" not in sp, sp
    plain = " ".join(format_heads_report(setup, [clm], 1e-5).split())
    assert "transformers 5.6" in plain and "Ulysses" not in plain, plain
