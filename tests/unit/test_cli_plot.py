"""`hf-gradacc plot RUN_DIR`: the curves of a real tiny run (with TokenStatsCallback and GradientNoiseScaleCallback),
and clear usage errors (exit 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.callbacks import GradientNoiseScaleCallback, TokenStatsCallback
from hf_gradacc.commands.hf_gradacc_cli import main
from hf_gradacc.commands.plot import find_trainer_state, plot_run
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny causal-LM run saved every 3 steps (checkpoint-3, checkpoint-6), logged with TokenStatsCallback and
    GradientNoiseScaleCallback."""
    out = tmp_path_factory.mktemp("run")
    args = GradAccConfig(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=6,
        logging_steps=1, save_strategy="steps", save_steps=3, report_to=[], disable_tqdm=True, use_cpu=True,
        learning_rate=1e-3, eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4,
    )  # fmt: skip
    trainer = GradAccTrainer(
        model=build_tiny_model("causal_lm"), args=args, data_collator=PaddingCollator(),
        train_dataset=ListDataset(make_samples("causal_lm", 48, seed=2)),
        eval_dataset=ListDataset(make_samples("causal_lm", 4, seed=3)), callbacks=[TokenStatsCallback(), GradientNoiseScaleCallback()],
    )  # fmt: skip
    trainer.train()
    return out


def test_plot_a_run_dir_through_its_newest_checkpoint(run_dir: Path, capsys) -> None:
    assert not (run_dir / "trainer_state.json").exists()
    assert find_trainer_state(str(run_dir)) == str(run_dir / "checkpoint-6" / "trainer_state.json")
    assert main(["plot", str(run_dir)]) == 0
    out = capsys.readouterr().out
    image = run_dir / "curves.png"
    assert image.read_bytes()[:8] == PNG_MAGIC and image.stat().st_size > 10_000
    for panel in ("loss", "grad norm", "learning rate", "throughput", "padding ratio", "effective batch"):
        assert panel in out, out
    assert "gradient noise scale" in out, out
    assert "checkpoint-6" in out


def test_plot_draws_the_noise_scale_beside_the_batch(run_dir: Path, tmp_path: Path) -> None:
    """The panel holds `gns` and the step's batch `gns/batch_size`; the batch alone (while the smoothed |G|^2 is not
    positive, the callback logs no `gns`) draws no noise-scale panel."""
    from hf_gradacc.commands import plot

    state_path = find_trainer_state(str(run_dir))
    history = json.loads(Path(state_path).read_text())["log_history"]
    assert any("gns" in h for h in history)  # the fixture's run logged it
    steps, values = plot._series(history, "gns")
    assert steps and all(v > 0 for v in values)
    assert "gradient noise scale" in plot_run(state_path, str(tmp_path / "all.png"))

    batch_only = [{k: v for k, v in h.items() if k != "gns"} for h in history]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": batch_only}))
    assert "gradient noise scale" not in plot_run(str(tmp_path / "trainer_state.json"), str(tmp_path / "x.png"))


def test_plot_draws_only_the_panels_the_run_logged(run_dir: Path, tmp_path: Path) -> None:
    state = json.loads((run_dir / "checkpoint-6" / "trainer_state.json").read_text())
    keep = ("loss", "step", "epoch")
    state["log_history"] = [{k: v for k, v in h.items() if k in keep} for h in state["log_history"]]
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    assert plot_run(find_trainer_state(str(tmp_path)), str(tmp_path / "x.png")) == ["loss"]
    assert (tmp_path / "x.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_output_option(run_dir: Path, tmp_path: Path, capsys) -> None:
    target = tmp_path / "elsewhere.png"
    assert main(["plot", str(run_dir / "checkpoint-3"), "--output", str(target)]) == 0
    assert target.read_bytes()[:8] == PNG_MAGIC
    assert "checkpoint-3" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "is not a directory"),
        (lambda p: p, "has no trainer_state.json, nor a checkpoint-*/ folder with a complete one"),
    ],
)
def test_missing_run_dir_or_state_is_a_usage_error(tmp_path: Path, capsys, make, message: str) -> None:
    (tmp_path / "checkpoint-4").mkdir()  # killed while saving: no trainer_state.json
    assert main(["plot", str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-gradacc plot: error: ") and message in err
    assert not (tmp_path / "curves.png").exists()


def test_a_state_without_training_logs_is_a_usage_error(tmp_path: Path, capsys) -> None:
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 0, "log_history": []}))
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no logged training metric to plot" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(run_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["plot", str(run_dir), "--output", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "hf-gradacc plot needs matplotlib" in err and "pip install hf_gradacc[plot]" in err
    assert not (tmp_path / "x.png").exists()


def test_plot_draws_the_expert_load_of_a_moe_run(tmp_path: Path) -> None:
    """A mixture-of-experts run logs `moe/load_max_over_mean` (both router_balance modes): its panel is drawn, and only
    when the history holds the key. The history is hand-made (the key the trainer logs: moe_balance.LOAD_KEY)."""
    from hf_gradacc.commands import plot
    from hf_gradacc.moe_balance import LOAD_KEY

    history = [{"step": s, "loss": 4.0 - 0.1 * s, LOAD_KEY: 1.0 + 0.4 / s} for s in range(1, 5)]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert plot_run(str(tmp_path / "trainer_state.json"), str(tmp_path / "moe.png")) == ["loss", "expert load"]
    assert plot._series(history, LOAD_KEY)[1] == pytest.approx([1.4, 1.2, 1 + 0.4 / 3, 1.1])
    dense = [{k: v for k, v in h.items() if k != LOAD_KEY} for h in history]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": dense}))
    assert plot_run(str(tmp_path / "trainer_state.json"), str(tmp_path / "dense.png")) == ["loss"]
