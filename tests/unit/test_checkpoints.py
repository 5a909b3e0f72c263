"""Complete means resumable: a checkpoint is taken only when every file the resume reads is there, for every rank, and
readable; a kill at any point of a save leaves the old checkpoint or a complete new one (property over kill points).

A kill is simulated on the files of a real save: the folder holds the first ``k`` files of the save's write order,
the next one cut short (or not at all), and no marker unless the save got past its barrier. The 2-rank case adds rank
1's ``rng_state_1.pth`` at any place in rank 0's order (the ranks write in parallel), and a kill of rank 1 alone (rank
0 writes everything but never passes the barrier that comes before the marker).
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from transformers import TrainerCallback

from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccTrainer
from hf_gradacc import checkpoints as ckpt
from hf_gradacc.checkpoints import COMPLETE_NAME, SAVING_NAME, checkpoint_problems, latest_complete_checkpoint
from hf_gradacc.errors import GradAccDistributedError
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

BS, GA, STEPS = 2, 2, 3
# The order `Trainer._save_checkpoint` writes in (save_model, optimizer and scheduler, RNG, trainer state).
WRITE_ORDER = ("model.safetensors", "config.json", "generation_config.json", "training_args.bin", "optimizer.pt",
               "scheduler.pt", "rng_state.pth", "trainer_state.json")  # fmt: skip


def _trainer(out: str, **overrides) -> GradAccTrainer:
    kwargs = dict(per_device_train_batch_size=BS, gradient_accumulation_steps=GA, max_steps=-1, num_train_epochs=1,
                  save_strategy="steps", save_steps=1, optim="adamw_torch", learning_rate=1e-2)  # fmt: skip
    args = one_step_args(out, args_class=GradAccConfig, **{**kwargs, **overrides})
    samples = make_samples("causal_lm", BS * GA * STEPS, seed=21)
    return GradAccTrainer(model=build_tiny_model("causal_lm"), args=args, train_dataset=ListDataset(samples),
                          data_collator=PaddingCollator())  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A run of 3 steps saving each step: its output_dir and its final parameters."""
    out = str(tmp_path_factory.mktemp("saved"))
    trainer = _trainer(out)
    trainer.train()
    return out, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _write_killed(saved_ckpt: str, folder: str, order: list[str], written: int, cut: float | None, marked: bool,
                  files: dict[str, bytes]) -> None:  # fmt: skip
    """``folder`` as a save killed after ``written`` files of ``order`` (the next one cut to ``cut`` of its size)."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    if marked:
        open(os.path.join(folder, SAVING_NAME), "w").close()
    for name in order[:written]:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(files[name])
    if cut is not None and written < len(order):
        data = files[order[written]]
        with open(os.path.join(folder, order[written]), "wb") as f:
            f.write(data[: int(len(data) * cut)])
    if marked and written == len(order):
        ckpt._write_marker(folder)


def _files(checkpoint: str, ranks: int) -> dict[str, bytes]:
    files = {}
    for name in WRITE_ORDER:
        with open(os.path.join(checkpoint, name), "rb") as f:
            files[name] = f.read()
    if ranks == 2:
        files["rng_state_0.pth"] = files["rng_state_1.pth"] = files.pop("rng_state.pth")
    return files


def test_a_save_leaves_its_marker_and_every_checkpoint_resumable(saved) -> None:
    out, _ = saved
    for step in range(1, STEPS + 1):
        folder = os.path.join(out, f"checkpoint-{step}")
        assert os.path.isfile(os.path.join(folder, COMPLETE_NAME)) and not os.path.exists(os.path.join(folder, SAVING_NAME))
        listed = json.load(open(os.path.join(folder, COMPLETE_NAME)))["files"]
        assert set(listed) == {*WRITE_ORDER, ckpt.DATA_NAME}, listed
        assert checkpoint_problems(folder) == []
    assert latest_complete_checkpoint(out).endswith(f"checkpoint-{STEPS}")


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("marked", [True, False], ids=["hf_gradacc_save", "stock_save"])
def test_a_kill_at_any_point_leaves_the_old_checkpoint_or_a_complete_new_one(saved, tmp_path, ranks, marked, caplog) -> None:
    out, _ = saved
    files = _files(os.path.join(out, "checkpoint-2"), ranks)
    shutil.copytree(os.path.join(out, "checkpoint-1"), tmp_path / "checkpoint-1")
    if ranks == 2:  # checkpoint-1 as 2 ranks wrote it
        old = tmp_path / "checkpoint-1"
        os.replace(old / "rng_state.pth", old / "rng_state_0.pth")
        shutil.copy(old / "rng_state_0.pth", old / "rng_state_1.pth")
        ckpt._write_marker(str(old))
    rank0 = [n if n != "rng_state.pth" or ranks == 1 else "rng_state_0.pth" for n in WRITE_ORDER]
    orders = [rank0] if ranks == 1 else [rank0[:i] + ["rng_state_1.pth"] + rank0[i:] for i in range(len(rank0) + 1)]
    new = str(tmp_path / "checkpoint-2")
    seen = 0
    for order in orders:
        for written in range(len(order) + 1):
            for cut in (None, 0.0, 0.5):
                if cut is not None and written == len(order):
                    continue
                _write_killed(out, new, order, written, cut, marked, files)
                caplog.clear()
                with caplog.at_level(logging.WARNING):
                    chosen = latest_complete_checkpoint(str(tmp_path), world_size=ranks)
                complete = written == len(order)
                assert chosen.endswith("checkpoint-2" if complete else "checkpoint-1"), (order, written, cut)
                assert checkpoint_problems(chosen, world_size=ranks) == []
                if not complete:  # the warning names the file that is missing or broken
                    message = " ".join(r.getMessage() for r in caplog.records)
                    named = any(n in message for n in order[written:]) or (marked and SAVING_NAME in message)
                    assert "checkpoint-2" in message and named, (order[written:], message)
                seen += 1
    if ranks == 2 and marked:  # rank 1 killed: rank 0 wrote all its files, the barrier before the marker never passed
        _write_killed(out, new, rank0, len(rank0), None, False, files)
        open(os.path.join(new, SAVING_NAME), "w").close()
        assert latest_complete_checkpoint(str(tmp_path), world_size=2).endswith("checkpoint-1")
    assert seen >= len(WRITE_ORDER) * 3


def test_a_killed_save_resumes_from_the_old_checkpoint_exactly(saved, tmp_path, monkeypatch) -> None:
    """A save killed after every file but before the marker, with ``save_total_limit=1``: the older checkpoint is
    still there (rotation waits for the marker), the resume takes it and ends with the uninterrupted run's weights."""
    _, final = saved
    out = str(tmp_path / "run")
    calls = {"n": 0}
    write_marker = ckpt._write_marker

    def killed_at_the_second_marker(folder: str) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed while saving")
        write_marker(folder)

    monkeypatch.setattr(ckpt, "_write_marker", killed_at_the_second_marker)
    with pytest.raises(KeyboardInterrupt):
        _trainer(out, save_total_limit=1).train()
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-2"]
    monkeypatch.setattr(ckpt, "_write_marker", write_marker)
    resumed = _trainer(out, save_total_limit=1)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == STEPS
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param.detach(), final[name], rtol=0, atol=0)


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda d: os.remove(os.path.join(d, "optimizer.pt")), "optimizer.pt is missing"),
        (lambda d: _truncate(os.path.join(d, "model.safetensors")), "model.safetensors has"),
        (lambda d: _truncate(os.path.join(d, "trainer_state.json")), "trainer_state.json has"),
        (lambda d: os.remove(os.path.join(d, COMPLETE_NAME)) or _truncate(os.path.join(d, "optimizer.pt")),
         "optimizer.pt is unreadable"),
        (lambda d: os.remove(os.path.join(d, COMPLETE_NAME)) or _truncate(os.path.join(d, "model.safetensors")),
         "model.safetensors is truncated"),
        (lambda d: os.remove(os.path.join(d, COMPLETE_NAME)) or _truncate(os.path.join(d, "trainer_state.json")),
         "trainer_state.json is unreadable"),
        (lambda d: os.remove(os.path.join(d, COMPLETE_NAME)) or os.remove(os.path.join(d, "optimizer.pt")),
         "save_only_model"),
    ],
    ids=["no_optimizer", "short_weights", "short_state", "stock_short_optimizer", "stock_short_weights",
         "stock_short_state", "stock_no_optimizer"],
)
def test_an_explicit_checkpoint_that_cannot_be_resumed_is_a_clear_error(saved, tmp_path, damage, named) -> None:
    out, _ = saved
    folder = str(tmp_path / "checkpoint-2")
    shutil.copytree(os.path.join(out, "checkpoint-2"), folder)
    damage(folder)
    with pytest.raises(GradAccConfigError) as info:
        _trainer(str(tmp_path)).train(resume_from_checkpoint=folder)
    assert named in str(info.value) and folder in str(info.value) and "resume_from_checkpoint=True" in str(info.value)


def _truncate(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


@pytest.mark.parametrize(
    "change, named",
    [
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps=2 (this run: 4)"),
        ({"per_device_train_batch_size": 4}, "per_device_train_batch_size=2 (this run: 4)"),
        ({"seed": 1}, "seed=42 (this run: 1)"),
        ({"accumulation_schedule": "0:2,2:4"}, "accumulation_schedule=None"),
        ({"world_size": 2}, "world_size=2 (this run: 1)"),  # a checkpoint of 2 ranks resumed on 1 process
    ],
    ids=["ga", "batch", "seed", "schedule", "world_size"],
)
def test_resuming_an_unrecorded_position_with_another_data_layout_is_a_clear_error(saved, tmp_path, change, named) -> None:
    """A record without its position in samples (written before hf_gradacc recorded it): the resume would skip
    global_step x THIS run's samples per step, so a changed layout would lose or repeat samples. (With the position,
    a changed batch, GA, schedule or world size resumes exactly: tests/unit/test_resume_layout.py.)"""
    out, _ = saved
    folder = str(tmp_path / "checkpoint-1")
    shutil.copytree(os.path.join(out, "checkpoint-1"), folder)
    overrides = dict(change)
    path = os.path.join(folder, ckpt.DATA_NAME)
    layout = json.load(open(path))
    del layout[ckpt.POSITION_KEY]
    if "world_size" in overrides:  # the checkpoint's record says 2 ranks
        layout["world_size"] = overrides.pop("world_size")
    json.dump(layout, open(path, "w"))
    ckpt._write_marker(folder)
    with pytest.raises(GradAccConfigError) as info:
        _trainer(str(tmp_path), **overrides).train(resume_from_checkpoint=folder)
    assert named in str(info.value) and "samples would be lost" in str(info.value), str(info.value)
    with pytest.raises(GradAccConfigError):  # `True` picks that folder and refuses it alike
        _trainer(str(tmp_path), **overrides).train(resume_from_checkpoint=True)


def test_an_interrupted_save_is_passed_over_by_its_saving_marker_and_reported(saved, tmp_path, caplog) -> None:
    """checkpoint-2 with every file the resume reads there and readable, ``hf_gradacc_saving`` and no completion
    marker (killed after the Trainer's last file, before the marker; or another rank's file not listed by the stock
    checks): only the saving marker tells that the save never finished. It is passed over, and the warning says so."""
    out, _ = saved
    for name in ("checkpoint-1", "checkpoint-2"):
        shutil.copytree(os.path.join(out, name), tmp_path / name)
    new = tmp_path / "checkpoint-2"
    os.remove(new / COMPLETE_NAME)
    open(new / SAVING_NAME, "w").close()
    problems = checkpoint_problems(str(new))
    assert len(problems) == 1 and SAVING_NAME in problems[0] and "never finished" in problems[0], problems
    with caplog.at_level(logging.WARNING):
        assert latest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "checkpoint-2" in message and SAVING_NAME in message, message
    with pytest.raises(GradAccConfigError, match=SAVING_NAME):
        _trainer(str(tmp_path)).train(resume_from_checkpoint=str(new))


@pytest.mark.parametrize("marked", [True, False], ids=["hf_gradacc_save", "stock_save"])
def test_on_a_node_local_disk_a_rank_needs_only_its_own_rng_state(saved, tmp_path, marked) -> None:
    """A folder on node 1's own disk holds rank 1's RNG state only (every rank writes its own, on its own disk): rank
    1 can resume it (it reads only its own); rank 0, or a check of every rank's files, names rank 0's as missing."""
    out, _ = saved
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(os.path.join(out, "checkpoint-2"), folder)
    os.replace(folder / "rng_state.pth", folder / "rng_state_1.pth")
    record = json.load(open(folder / ckpt.DATA_NAME))
    json.dump({**record, "world_size": 2}, open(folder / ckpt.DATA_NAME, "w"))
    if marked:
        ckpt._write_marker(str(folder))
    else:
        os.remove(folder / COMPLETE_NAME)
    assert checkpoint_problems(str(folder), world_size=2, rank=1) == []
    assert "rng_state_0.pth is missing" in checkpoint_problems(str(folder), world_size=2, rank=0)
    if not marked:  # the marker lists every rank's files of a shared disk; the stock check asks for every rank's
        assert checkpoint_problems(str(folder), world_size=2) == ["rng_state_0.pth is missing"]


def test_another_ranks_record_is_overruled_by_rank_0s_or_refused_at_another_step(saved, monkeypatch, caplog) -> None:
    """What each rank read from its own disk, gathered (faked here): a record that differs at the same step is named
    in a warning and rank 0's decides; another step on rank 1 (its trainer_state.json) is a GradAccConfigError."""
    out, _ = saved
    folder = os.path.join(out, "checkpoint-1")
    mine = ckpt._read_record(folder)
    assert mine is not None
    record, step = mine
    other = {**record, ckpt.POSITION_KEY: {**record[ckpt.POSITION_KEY], "num_samples": 0}}
    monkeypatch.setattr(ckpt, "_gathered", lambda value: [value, (other, step)])
    with caplog.at_level(logging.WARNING):
        assert ckpt._rank_zero_record(folder) == mine
    assert f"rank 1's {ckpt.DATA_NAME} differs from rank 0's in ['position']" in caplog.text, caplog.text
    monkeypatch.setattr(ckpt, "_gathered", lambda value: [value, (record, step + 1)])
    with pytest.raises(GradAccConfigError, match=f"rank 0's folder holds step {step} and rank 1's step {step + 1}"):
        ckpt._rank_zero_record(folder)


def test_the_record_counts_the_data_ranks_so_a_changed_cp_size_on_the_same_processes_is_seen(saved, tmp_path, monkeypatch) -> None:
    """cp 2 on 2 processes holds 1 data rank: the record says ``data_parallel_size`` 1 beside ``world_size`` 2, and a
    checkpoint recorded so, resumed with cp 1 on the same 2 processes, names the change (the world size alone would
    not show it)."""
    from hf_gradacc.backends.mesh import Mesh

    out, _ = saved
    trainer = _trainer(str(tmp_path / "run"))
    monkeypatch.setattr(type(trainer.args), "world_size", property(lambda self: 2))

    def layout(cp: int) -> dict:  # the record of a run on 2 processes whose mesh has `cp` context-parallel ranks
        mesh = Mesh.of({"cp": cp, "dp_shard": 2 // cp})
        return ckpt.data_layout(trainer.args, trainer.gradacc, trainer.train_dataset,
                                data_parallel_size=mesh.data_parallel_size)

    record = layout(cp=2)
    assert (record["world_size"], record["data_parallel_size"]) == (2, 1), record
    folder = tmp_path / "checkpoint-1"
    shutil.copytree(os.path.join(out, "checkpoint-1"), folder)
    saved_record = json.load(open(folder / ckpt.DATA_NAME))
    json.dump({**saved_record, "world_size": 2, "data_parallel_size": 1}, open(folder / ckpt.DATA_NAME, "w"))
    point = ckpt.check_data_layout(str(folder), layout(cp=1))
    assert point is not None and point.changed == ("data_parallel_size 1 -> 2",), point


def _failing_save(monkeypatch, error: RuntimeError, at: str) -> None:
    """``torch.save`` raises ``error`` when it writes a file whose path holds ``at`` (the Trainer's optimizer.pt)."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if at in str(f):
            raise error
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_a_ranks_own_failure_in_a_save_is_raised_as_itself_not_as_a_lost_peer(tmp_path, monkeypatch) -> None:
    """torch.save on a full disk raises its own RuntimeError on the rank that writes: that error, not the lost-peer
    GradAccDistributedError (which would send the user to another rank's log), and the folder stays incomplete."""
    full_disk = RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                             "data/0: file write failed")  # fmt: skip
    _failing_save(monkeypatch, full_disk, at=os.path.join("checkpoint-2", "optimizer.pt"))
    with pytest.raises(RuntimeError) as info:
        _trainer(str(tmp_path)).train()
    assert info.value is full_disk, repr(info.value)
    assert not os.path.exists(tmp_path / "checkpoint-2" / COMPLETE_NAME)
    assert latest_complete_checkpoint(str(tmp_path)).endswith("checkpoint-1")


def test_a_save_that_loses_its_peer_names_the_newest_complete_checkpoint(tmp_path, monkeypatch) -> None:
    """A collective failure while checkpoint-3 is saved (a peer died): the GradAccDistributedError names the folder
    left incomplete and the checkpoint the next resume takes, checkpoint-2, the newest complete one (not checkpoint-1)."""
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500")
    _failing_save(monkeypatch, lost, at=os.path.join("checkpoint-3", "optimizer.pt"))
    with pytest.raises(GradAccDistributedError) as info:
        _trainer(str(tmp_path)).train()
    message = str(info.value)
    assert f"takes the previous complete one, {tmp_path / 'checkpoint-2'}" in message, message
    assert "checkpoint-1" not in message and f"{tmp_path / 'checkpoint-3'} is left incomplete" in message, message
    assert info.value.__cause__ is lost


def test_a_failed_finish_of_a_save_is_agreed_by_every_rank(tmp_path, monkeypatch) -> None:
    """The saving rank's finish (record, marker, rotation) is agreed in one collective before any rank leaves the
    save (``on_save`` copies it next): another rank's failed finish (gathered, faked here) is a
    GradAccDistributedError naming that rank and its error; this rank's own is raised as itself."""
    monkeypatch.setattr(ckpt, "_gathered", lambda value: [value, "OSError: [Errno 28] No space left on device"])
    with pytest.raises(GradAccDistributedError) as info:
        _trainer(str(tmp_path / "a")).train()
    message = str(info.value)
    assert "step 1: rank 1 failed to finish it (OSError: [Errno 28] No space left on device)" in message, message
    monkeypatch.setattr(ckpt, "_gathered", lambda value: [value])
    full = OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt, "_write_marker", lambda folder: (_ for _ in ()).throw(full))
    with pytest.raises(OSError) as own:
        _trainer(str(tmp_path / "b")).train()
    assert own.value is full


def test_a_copy_of_a_checkpoint_is_the_same_checkpoint_another_step_is_not(saved, tmp_path, monkeypatch) -> None:
    """:func:`checkpoint_identity`: a copy in another folder (also one whose trainer state a node's own main process
    wrote) is the same checkpoint; another step is not. Ranks naming different folders agree by it (gathered, faked
    here): the same checkpoint resumes, two steps are refused naming each rank's folder and step."""
    out, _ = saved
    copy = tmp_path / "rank1" / "checkpoint"
    shutil.copytree(os.path.join(out, "checkpoint-1"), copy)
    state = json.load(open(copy / "trainer_state.json"))
    json.dump({**state, "is_world_process_zero": False}, open(copy / "trainer_state.json", "w"))
    first = ckpt.checkpoint_identity(os.path.join(out, "checkpoint-1"))
    assert first is not None and first.startswith("global step 1, trainer state ")
    assert ckpt.checkpoint_identity(str(copy)) == first
    assert ckpt.checkpoint_identity(os.path.join(out, "checkpoint-2")).startswith("global step 2, ")
    ckpt._write_marker(str(copy))  # the marker lists the rewritten trainer state's size

    def gathered_with(folder: str):
        return lambda value: [value, (folder, checkpoint_problems(folder), ckpt.checkpoint_identity(folder))]

    mine = os.path.join(out, "checkpoint-1")
    monkeypatch.setattr(ckpt, "_gathered", gathered_with(str(copy)))
    assert ckpt._agreed_folder(mine, world_size=1, rank=0) == []
    monkeypatch.setattr(ckpt, "_gathered", gathered_with(os.path.join(out, "checkpoint-2")))
    problems = ckpt._agreed_folder(mine, world_size=1, rank=0)
    assert len(problems) == 1 and "the ranks' folders hold different checkpoints" in problems[0], problems
    assert f"rank 0's {mine!r}: global step 1" in problems[0] and "checkpoint-2': global step 2" in problems[0]
    monkeypatch.setattr(ckpt, "_gathered", gathered_with(str(tmp_path / "absent")))
    assert ckpt._agreed_folder(mine, world_size=1, rank=0) == [f"{tmp_path / 'absent'} is not a folder (rank 1)"]


def _sharded_at_load(**sizes) -> torch.nn.Module:
    """A tiny model marked as sharded at load time (what ``from_pretrained(distributed_config=...)`` sets)."""
    from transformers.distributed import DistributedConfig

    model = build_tiny_model("causal_lm")
    model.config.distributed_config = DistributedConfig(**sizes)
    model._is_distributed_loading_by_transformers = True
    return model


@pytest.mark.parametrize("save_strategy, sharded, warned", [("steps", True, True), ("epoch", True, True),
                                                            ("no", True, False), ("steps", False, False)])  # fmt: skip
def test_a_model_sharded_at_load_time_is_told_at_construction_its_checkpoints_cannot_be_resumed(
    tmp_path, caplog, save_strategy, sharded, warned
) -> None:
    """transformers saves no optimizer state for a model sharded at load time (its Trainer saves checkpoints of it
    only with ``save_only_model=True``) and the resume refuses such a checkpoint: said when the trainer is built,
    with the way out, not after the run wrote them all."""
    model = _sharded_at_load() if sharded else build_tiny_model("causal_lm")
    args = one_step_args(str(tmp_path), args_class=GradAccConfig, per_device_train_batch_size=BS,
                         gradient_accumulation_steps=GA, save_strategy=save_strategy, save_only_model=True)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        GradAccTrainer(model=model, args=args, train_dataset=ListDataset(make_samples("causal_lm", 4)),
                       data_collator=PaddingCollator())  # fmt: skip
    found = [r.getMessage() for r in caplog.records if "saves checkpoints that cannot be resumed" in r.getMessage()]
    assert len(found) == int(warned), found
    if warned:
        for part in (f"`save_strategy={save_strategy!r}`", "sharded at load time", "from_pretrained(<checkpoint>",
                     "without `resume_from_checkpoint`", "`save_strategy='no'`", "trainer.save_model()"):  # fmt: skip
            assert part in found[0], (part, found[0])


def test_the_warning_names_the_load_time_layout(caplog) -> None:
    from types import SimpleNamespace

    from hf_gradacc.backends.sharded_model import check_model_sharding

    model = torch.nn.Linear(2, 2)
    model.config = _sharded_at_load(tp_size=2, fsdp_size=2).config
    model._is_distributed_loading_by_transformers = True
    with caplog.at_level(logging.WARNING):
        check_model_sharding(model, SimpleNamespace(save_strategy="steps"))
        check_model_sharding(model)  # without the trainer's args: no warning
    found = [r.getMessage() for r in caplog.records if "cannot be resumed" in r.getMessage()]
    assert len(found) == 1 and "`DistributedConfig(tp_size=2, fsdp_size=2)`" in found[0], found


def test_resume_true_agrees_on_the_checkpoint_by_content_too(saved, monkeypatch) -> None:
    """`resume_from_checkpoint=True` on node-local disks: every rank picks the same newest name, and the ranks'
    folders of that name must hold the same checkpoint (another run's checkpoint-3 on rank 1's disk, faked through
    the gather here) — refused on every rank, naming both, where it was agreed by name alone."""
    import types

    out, _ = saved
    newest = os.path.join(out, "checkpoint-3")
    other = ("/node1/out/checkpoint-3", [], "global step 3, trainer state 0123456789ab")

    def rank_1_holds_another_run(value):
        return [value, other] if isinstance(value, tuple) else [value, value]

    monkeypatch.setattr(ckpt, "_gathered", rank_1_holds_another_run)
    args = types.SimpleNamespace(world_size=2, process_index=0, output_dir=out)
    with pytest.raises(GradAccConfigError) as info:
        ckpt.resolve_resume(True, args=args, layout=dict, mismatch="error", blocker=None)
    message = str(info.value)
    assert "the ranks' folders hold different checkpoints" in message and f"rank 0's {newest!r}" in message, message
    assert "picked it as the newest complete one" in message, message
    monkeypatch.setattr(ckpt, "_gathered", lambda value: [value, value])  # the same checkpoint on both disks
    path, _ = ckpt.resolve_resume(True, args=args, layout=dict, mismatch="accept", blocker=None)  # layout: not judged
    assert path == newest


def test_the_resume_field_set_but_not_passed_to_train_is_a_warning(saved, tmp_path, caplog) -> None:
    """`TrainingArguments.resume_from_checkpoint` is never read by the Trainer (scripts pass it to `train()`): set and
    not passed, training starts over, so it warns naming the value and run_clm.py's call; passed, no warning."""
    out, _ = saved
    folder = os.path.join(out, "checkpoint-2")
    class Trained(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    with caplog.at_level(logging.WARNING):
        trainer = _trainer(str(tmp_path / "a"), resume_from_checkpoint=folder, save_strategy="no")
        trainer.add_callback(trained := Trained())
        trainer.train()
    message = " ".join(r.getMessage() for r in caplog.records)
    assert f"`resume_from_checkpoint` ('{folder}') is set" in message and "starts from the beginning" in message
    assert "trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)" in message, message
    assert trained.steps == list(range(1, STEPS + 1))  # it did start over: the warning is true
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        trainer = _trainer(str(tmp_path / "b"), resume_from_checkpoint=folder, save_strategy="no")
        trainer.add_callback(resumed := Trained())
        trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    assert "starts from the beginning" not in " ".join(r.getMessage() for r in caplog.records)
    assert resumed.steps == list(range(3, STEPS + 1))  # resumed: step 3 is the first one trained
