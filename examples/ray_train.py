"""GradAccTrainer under Ray Train, wired as Ray's Hugging Face Transformers guide wires a Trainer: ``TorchTrainer`` runs
``train_func`` on every worker, ``RayTrainReportCallback`` reports each checkpoint, ``prepare_trainer`` prepares the
trainer, and a restarted worker group resumes from ``ray.train.get_checkpoint()``.

    pip install "hf_gradacc[ray]"
    python examples/ray_train.py --output_dir out                       # 2 CPU workers
    python examples/ray_train.py --output_dir out --fail_after_step 2   # worker 1 dies after checkpoint 2 (once);
                                                                         # FailureConfig restarts the group, resumed
    python examples/ray_train.py --output_dir out --fail_after_step 2 --own_copy   # each worker resumes from its own
                                                                         # download of the checkpoint (multi-node)
    torchrun --nproc_per_node 2 examples/ray_train.py --output_dir ref --without_ray   # the same run without Ray

A tiny causal LM on 24 synthetic samples (per-device batch 2, GA 2, 2 workers: 3 optimizer steps, a checkpoint each);
put your model and data in ``build_trainer``. Each run writes ``<output_dir>/result.json``: the final checkpoint
folder and, for a resumed worker group, the checkpoint each worker resumed from.
tests/distributed/test_ray_train.py runs this script as printed and compares the final weights with the run without
Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from transformers import TrainerCallback

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples


def build_trainer(output_dir: str) -> GradAccTrainer:
    """Your model, data and arguments: here a tiny causal LM, a checkpoint every optimizer step, CPU workers."""
    args = GradAccConfig(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
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

    trainer = build_trainer(config["output_dir"])
    trainer.add_callback(RayTrainReportCallback())
    if config.get("fail_after_step"):
        trainer.add_callback(FailOnce(config["fail_after_step"], config["failed_marker"]))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--fail_after_step", type=int, default=0, help="worker 1 fails once after this checkpoint")
    parser.add_argument("--own_copy", action="store_true", help="each worker resumes from its own copy")
    parser.add_argument("--without_ray", action="store_true", help="the same run under torchrun, for comparison")
    options = parser.parse_args()
    output_dir = os.path.abspath(options.output_dir)
    if options.without_ray:
        trainer = build_trainer(os.path.join(output_dir, "train"))
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
    }
    ray_trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=options.num_workers, use_gpu=False),
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
