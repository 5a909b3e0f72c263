"""GradAccTrainer under Ray Train, wired as Ray's Hugging Face Transformers guide wires a Trainer: ``TorchTrainer`` runs
``train_func`` on every worker, ``RayTrainReportCallback`` reports each checkpoint, ``prepare_trainer`` prepares the
trainer, and a restarted worker group resumes from ``ray.train.get_checkpoint()``.

    pip install "hf_gradacc[ray]"
    python examples/ray_train.py --output_dir out                       # 2 CPU workers
    python examples/ray_train.py --output_dir out --fail_after_step 2   # worker 1 dies after checkpoint 2 (once);
                                                                         # FailureConfig restarts the group, resumed
    python examples/ray_train.py --output_dir out --fail_after_step 2 --own_copy   # each worker resumes from its own
                                                                         # download of the checkpoint (multi-node)
    python examples/ray_train.py --output_dir out --min_workers 1 --num_workers 2 --total_train_batch_size 8
                                         # elastic: ScalingConfig(num_workers=(1, 2)); GA follows the workers present
    torchrun --nproc_per_node 2 examples/ray_train.py --output_dir ref --without_ray   # the same run without Ray

A tiny causal LM on 24 synthetic samples (per-device batch 2, GA 2, 2 workers: 3 optimizer steps, a checkpoint each);
put your model and data in ``build_trainer``. Each run writes ``<output_dir>/result.json``: the final checkpoint
folder and, for a resumed worker group, the checkpoint each worker resumed from; ``<output_dir>/train/starts.jsonl``
has one line per (re)start: the workers, the accumulation and the step it started from.
tests/distributed/test_ray_train.py runs this script as printed and compares the final weights with the run without
Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from transformers import TrainerCallback

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples


def build_trainer(
    output_dir: str, total_train_batch_size: int = 0, gradient_accumulation_steps: int = 2
) -> GradAccTrainer:
    """Your model, data and arguments: here a tiny causal LM, a checkpoint every optimizer step, CPU workers. With
    ``total_train_batch_size`` the accumulation follows the workers present (elastic runs); else it is fixed."""
    if total_train_batch_size:
        batch = {"total_train_batch_size": total_train_batch_size}
    else:
        batch = {"gradient_accumulation_steps": gradient_accumulation_steps}
    args = GradAccConfig(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        **batch,
        num_train_epochs=1,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=1,
        logging_steps=1,
        seed=0,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_timeout=60,
        report_to="none",
    )
    samples = make_samples("causal_lm", 24, seed=11)
    return GradAccTrainer(
        model=build_tiny_model("causal_lm", seed=0),
        args=args,
        train_dataset=ListDataset(samples),
        data_collator=PaddingCollator(),
    )


def train_func(config: dict) -> None:
    """What every Ray Train worker runs (Ray sets up the process group and the torch env vars first)."""
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    trainer = build_trainer(
        config["output_dir"], config.get("total_train_batch_size", 0), config.get("gradient_accumulation_steps", 2)
    )
    trainer.add_callback(RayTrainReportCallback())
    trainer.add_callback(RecordStarts(config["output_dir"]))
    if config.get("fail_after_step"):
        trainer.add_callback(FailOnce(config["fail_after_step"], config["failed_marker"]))
    if config.get("pause_after_step"):  # after RayTrainReportCallback: the checkpoint is reported first
        trainer.add_callback(PauseOnce(config["pause_after_step"], config["pause_dir"]))
    trainer = prepare_trainer(trainer)

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.train()
        return
    if config.get("own_copy"):  # each worker its own folder, as a download from cloud storage gives
        with tempfile.TemporaryDirectory() as own:
            checkpoint.to_directory(own)
            resume(trainer, os.path.join(own, RayTrainReportCallback.CHECKPOINT_NAME), config)
    else:
        with checkpoint.as_directory() as checkpoint_dir:
            resume(trainer, os.path.join(checkpoint_dir, RayTrainReportCallback.CHECKPOINT_NAME), config)


def resume(trainer: GradAccTrainer, folder: str, config: dict) -> None:
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(folder, "trainer_state.json")) as f:
        step = json.load(f)["global_step"]
    with open(os.path.join(config["output_dir"], f"resumed.rank{rank}.json"), "w") as f:
        json.dump({"folder": folder, "global_step": step, "files": sorted(os.listdir(folder))}, f)
    trainer.train(resume_from_checkpoint=folder)


class FailOnce(TrainerCallback):
    """Kills worker 1 right after it reported checkpoint ``step``, the first time only (a file marks it)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def on_save(self, args, state, control, **kwargs):
        if args.process_index == 1 and state.global_step == self.step and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise RuntimeError(f"injected failure of worker 1 after checkpoint {self.step}")


class RecordStarts(TrainerCallback):
    """Rank 0 appends one JSON line per (re)start to ``<output_dir>/starts.jsonl``: the workers present, the
    accumulation the run uses on them, the step it starts from."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir

    def on_train_begin(self, args, state, control, **kwargs):
        if args.process_index == 0:
            start = {"world_size": args.world_size, "gradient_accumulation_steps": args.gradient_accumulation_steps}
            os.makedirs(self.output_dir, exist_ok=True)
            with open(os.path.join(self.output_dir, "starts.jsonl"), "a") as f:
                f.write(json.dumps({**start, "global_step": state.global_step}) + "\n")


class PauseOnce(TrainerCallback):
    """After checkpoint ``step`` is reported, the first time only, each worker writes ``<pause_dir>/paused.rank<r>.json``
    (its Ray node) and waits for ``<pause_dir>/go``: the moment to take a node away (the elastic test removes one)."""

    def __init__(self, step: int, pause_dir: str, timeout_s: float = 300.0) -> None:
        self.step, self.pause_dir, self.timeout_s = step, pause_dir, timeout_s

    def on_save(self, args, state, control, **kwargs):
        import ray

        go = os.path.join(self.pause_dir, "go")
        if state.global_step != self.step or os.path.exists(go):
            return
        paused = {"node_id": ray.get_runtime_context().get_node_id(), "world_size": args.world_size}
        with open(os.path.join(self.pause_dir, f"paused.rank{args.process_index}.json"), "w") as f:
            json.dump(paused, f)
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {go} within {self.timeout_s} s of checkpoint {self.step}")
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--num_workers", type=int, default=2, help="the workers (the most, with --min_workers)")
    parser.add_argument("--min_workers", type=int, default=0, help="elastic: run on min_workers to num_workers")
    parser.add_argument("--total_train_batch_size", type=int, default=0, help="samples per step (elastic runs)")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2, help="without the total")
    parser.add_argument("--pause_after_step", type=int, default=0, help="wait after this checkpoint, once (tests)")
    parser.add_argument("--fail_after_step", type=int, default=0, help="worker 1 fails once after this checkpoint")
    parser.add_argument("--own_copy", action="store_true", help="each worker resumes from its own copy")
    parser.add_argument("--without_ray", action="store_true", help="the same run under torchrun, for comparison")
    options = parser.parse_args()
    output_dir = os.path.abspath(options.output_dir)
    if options.without_ray:
        trainer = build_trainer(
            os.path.join(output_dir, "train"), options.total_train_batch_size, options.gradient_accumulation_steps
        )
        trainer.train()
        if trainer.args.process_index == 0:
            final = os.path.join(output_dir, "train", f"checkpoint-{trainer.state.global_step}")
            with open(os.path.join(output_dir, "result.json"), "w") as f:
                json.dump({"checkpoint": final}, f)
        return

    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config = {
        "output_dir": os.path.join(output_dir, "train"),
        "fail_after_step": options.fail_after_step,
        "failed_marker": os.path.join(output_dir, "failed_once"),
        "own_copy": options.own_copy,
        "total_train_batch_size": options.total_train_batch_size,
        "gradient_accumulation_steps": options.gradient_accumulation_steps,
        "pause_after_step": options.pause_after_step,
        "pause_dir": output_dir,
    }
    workers = (options.min_workers, options.num_workers) if options.min_workers else options.num_workers
    ray_trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(
            name="run",
            storage_path=os.path.join(output_dir, "ray_results"),
            failure_config=FailureConfig(max_failures=1),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = ray_trainer.fit()
    with result.checkpoint.as_directory() as folder:
        final = os.path.join(folder, "checkpoint")
    with open(os.path.join(output_dir, "result.json"), "w") as f:
        json.dump({"checkpoint": final, "failed_once": os.path.exists(config["failed_marker"])}, f)


if __name__ == "__main__":
    main()
