"""One rank of tests/distributed/test_context_parallel.py: accelerate ``cp_size`` 2 x FSDP2 on 2 CPU ranks (the
attention through :mod:`cpu_context_parallel`'s exact all-gather stand-in for torch's ring attention), one SGD(lr=1)
step of GradAccTrainer (and, with ``stock`` in the arguments, of the stock Trainer) against the float64 full batch,
after an evaluation whose ``eval_loss`` is compared with the float64 one of the unsharded batches; then a sequence
classifier, refused at construction, and left-padded batches on rank 1 only (its ranks must all stop, agreed, in
training and in evaluation, none waiting in a collective); last, ``hf-gradacc check`` in this process under the
environment ``accelerate launch`` gives the shipped ``cp_fsdp2.yaml`` (the stand-in attention installed; the check
tears the process group down). Writes ``cp.rank<r>.json``.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from accelerate.parallelism_config import ParallelismConfig
from cpu_context_parallel import install
from transformers import Trainer, TrainingArguments

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.backends import mesh_from_accelerator
from hf_gradacc.errors import GradAccError
from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu
from hf_gradacc.testing.one_step import full_parameters, one_step_args
from hf_gradacc.testing.reference import compare, float64_copy, full_batch_loss, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers._common import finish_worker, rank, world_size, write_result

CP, BS, GA, EVAL_BS = 2, 2, 3, 3
# HSDP x CP by hand (8 ranks: HF_GRADACC_CP_REPLICATE=2): dp_replicate x dp_shard x cp; not in CI (8 processes).
REPLICATE = int(os.environ.get("HF_GRADACC_CP_REPLICATE", "1"))


def mesh(dp: int) -> ParallelismConfig:
    return ParallelismConfig(dp_replicate_size=REPLICATE, dp_shard_size=dp // REPLICATE, cp_size=CP)
WRAP = {"sequence_classification": {"transformer_layer_cls_to_wrap": ["BertLayer"]}}  # tied embeddings: per layer


def stock_collate(samples):  # the stock Trainer pads nothing itself: to 2 x cp_size, no mask
    batch = PaddingCollator()(samples)
    extra = -batch["input_ids"].shape[1] % (2 * CP)
    return {"input_ids": F.pad(batch["input_ids"], (0, extra)), "labels": F.pad(batch["labels"], (0, extra), value=-100)}


class LeftPaddingOnRankOne(PaddingCollator):
    """Right padding on rank 0, left padding on rank 1: one rank's data refused, the other's good."""

    def __call__(self, samples):
        batch = super().__call__(samples)
        if rank() != 1:
            return batch
        pads = (batch["attention_mask"] == 0).sum(1).tolist()
        return {k: torch.stack([row.roll(n) for row, n in zip(v, pads, strict=True)]) for k, v in batch.items()}


def eval_reference(parameters, samples) -> float:
    """``eval_loss`` of the unsharded batches in float64 (the tiny model with ``parameters``): each batch's token
    mean, weighted by its rows."""
    reference = float64_copy(build_tiny_model("causal_lm"))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(parameters[name])
    batches = [samples[i : i + EVAL_BS] for i in range(0, len(samples), EVAL_BS)]
    with torch.no_grad():
        means = [float(full_batch_loss(reference, PaddingCollator()(b), "causal_lm")) for b in batches]
    return sum(m * len(b) for m, b in zip(means, batches, strict=True)) / len(samples)


def refused(run) -> dict:
    """Rank 1 alone gets left-padded batches: every rank must stop with a GradAccDataError (within the launch's
    time limit: a rank left waiting in a collective would hang it)."""
    try:
        run()
    except GradAccError as error:
        return {"error_type": type(error).__name__, "error": str(error)}
    return {"error_type": None}


def refused_in_training() -> dict:
    dp = world_size() // CP
    samples = make_samples("causal_lm", BS * GA * dp, seed=5)
    args = one_step_args(tempfile.mkdtemp(prefix="hf_gradacc_cp_"), per_device_train_batch_size=BS,
                         gradient_accumulation_steps=GA, per_device_eval_batch_size=EVAL_BS, args_class=GradAccConfig,
                         fsdp=True, fsdp_config={"version": 2}, ddp_backend="gloo", use_cpu=True,
                         parallelism_config=mesh(dp))  # fmt: skip
    trainer = GradAccTrainer(model=build_tiny_model("causal_lm"), args=args, train_dataset=ListDataset(samples),
                             data_collator=LeftPaddingOnRankOne())  # fmt: skip
    return refused(trainer.train)


def one_step(kind: str, task: str = "causal_lm") -> dict:
    dp = world_size() // CP
    model = build_tiny_model(task)
    samples = make_samples(task, BS * GA * dp, seed=5)
    eval_samples = make_samples(task, 4 * EVAL_BS * dp + (dp == 1), seed=7)  # one data rank: a partial last batch
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = one_step_args(tempfile.mkdtemp(prefix="hf_gradacc_cp_"), per_device_train_batch_size=BS,
                         gradient_accumulation_steps=GA, args_class=GradAccConfig if kind == "gradacc" else TrainingArguments,
                         per_device_eval_batch_size=EVAL_BS,
                         fsdp=True, fsdp_config={"version": 2, **WRAP.get(task, {})}, ddp_backend="gloo", use_cpu=True,
                         parallelism_config=mesh(dp))  # fmt: skip
    trainer_class, collate = (GradAccTrainer, PaddingCollator()) if kind == "gradacc" else (Trainer, stock_collate)
    try:
        trainer = trainer_class(model=model, args=args, train_dataset=ListDataset(samples), data_collator=collate)
    except GradAccError as error:
        return {"error_type": type(error).__name__, "error": str(error)}
    trainer.train()
    final = full_parameters(trainer)
    evaluation = {}
    if task == "causal_lm":  # FSDP2 evaluates a prepared model: after the step (the stock Trainer's: by hand)
        evaluation = {"eval_loss": trainer.evaluate(ListDataset(eval_samples))["eval_loss"],
                      "eval_reference": eval_reference(final, eval_samples)}  # fmt: skip
    if kind == "gradacc" and task == "causal_lm":
        trainer.data_collator = LeftPaddingOnRankOne()
        evaluation["refused_evaluate"] = refused(lambda: trainer.evaluate(ListDataset(eval_samples)))
    update = {n: initial[n] - final[n].float() for n in initial}
    reference = reference_gradients(build_tiny_model(task), samples, task, PaddingCollator())
    return {"update": compare(update, reference).__dict__, "moved": sum(int(u.abs().sum() > 0) for u in update.values()),
            "parameters": len(update), "cp_size": trainer.accelerator.parallelism_config.cp_size,
            "cp_rank": trainer.step_engine.cp.rank if kind == "gradacc" else None, **evaluation,
            "mesh": mesh_from_accelerator(trainer.accelerator, trainer.model).describe()}  # fmt: skip


def run_check() -> dict:
    """`hf-gradacc check` (every built-in head) as ``accelerate launch --config_file cp_fsdp2.yaml`` would run it here:
    that launch's ``ACCELERATE_USE_*`` / ``FSDP_*`` / ``PARALLELISM_CONFIG_*`` variables (accelerate's own
    ``prepare_multi_gpu_env``), ``HF_GRADACC_CPU_DISTRIBUTED=1``; its exit status, printed report and JSON."""
    import argparse
    import contextlib
    import io
    import json
    from pathlib import Path

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from hf_gradacc.commands.check import check_command, check_command_parser

    config = Path(__file__).resolve().parents[3] / "examples" / "accelerate_configs" / "cp_fsdp2.yaml"
    launch = launch_command_parser().parse_args(["--config_file", str(config), "--num_processes", str(world_size()), "x"])
    launch_env = prepare_multi_gpu_env(_validate_launch_command(launch)[0])
    os.environ.update({k: v for k, v in launch_env.items()
                       if k.startswith(("ACCELERATE_USE_", "FSDP_", "PARALLELISM_CONFIG_"))})  # fmt: skip
    os.environ["HF_GRADACC_CPU_DISTRIBUTED"] = "1"
    parser = argparse.ArgumentParser(prog="hf-gradacc")
    check_command_parser(parser.add_subparsers(dest="command"))
    report = f"{tempfile.mkdtemp(prefix='check_cp_')}/check.json"
    opts = parser.parse_args(["check", "--json", report])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = check_command(opts)
    payload = {"status": status, "stdout": printed.getvalue()}
    if rank() == 0:
        payload["json"] = json.loads(Path(report).read_text())
    return payload


def main() -> None:
    install()
    enable_fsdp_on_cpu()
    torch.manual_seed(0)
    kinds = sys.argv[1:] or ["gradacc"]  # "stock": the stock Trainer on the same launch (recorded by hand)
    result = {kind: one_step(kind) for kind in kinds if kind != "check"}
    result["sequence_classification"] = one_step("gradacc", "sequence_classification")
    result["refused_train"] = refused_in_training()
    if "check" in kinds or not sys.argv[1:]:
        result["check"] = run_check()  # last: the check tears the process group down
    write_result("cp", result)
    finish_worker(0)


if __name__ == "__main__":
    main()
