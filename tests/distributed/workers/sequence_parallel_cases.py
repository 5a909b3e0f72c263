"""DeepSpeed Ulysses sequence parallelism (accelerate ``ParallelismConfig(sp_size=2, sp_backend="deepspeed")``) on 2
CPU ranks (gloo), launched with ``accelerate launch --config_file zero<N>_cpu.yaml`` and ``HF_GRADACC_CPU_DISTRIBUTED=1``.

One case per launch: ``--trainer gradacc`` (or ``stock``, the stock Trainer) trains one SGD step (lr 1) of a tiny
Llama (sdpa) on mixed-length samples with masked prompts, every micro-batch right-padded to one width (``WIDTH``).
The Trainer wraps the dataloader in DeepSpeed's ``UlyssesSPDataLoaderAdapter``: each of the GRAD_ACC micro-batches is
one rank's batch, cut along the sequence, so a step holds ``world x batch x GRAD_ACC / SP_SIZE`` samples. Each rank
reports the update's distance from the float64 full batch over those samples, or the error the run ended with.
``--paddings right,right-mask,left``: one run per padding (:class:`SequenceCollator`), each reported under its name.

Found on CPU (DeepSpeed 0.19.8, gloo): the adapter all-gathers every rank's batch, and gloo needs equal shapes (a
batch padded to its own longest row fails: "ProcessGroupGloo::allgather: invalid tensor size"); the stock Trainer's
loss needs a contiguous ``shift_labels``, which the adapter's slice of a batch of more than one row is not on CPU
("view size is not compatible with input tensor's size and stride", ForCausalLMLoss): ``--batch 1`` runs it.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import traceback
from typing import Any

import torch
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig
from transformers import Trainer, TrainingArguments

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.callbacks import TokenStatsCallback
from hf_gradacc.commands.check.sp_rows import one_sequence_parallel_set_up
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers._common import finish_worker, rank, world_size, write_result
from tests.distributed.workers.mesh_cases import Budget

PER_DEVICE_BATCH = 2
GRAD_ACC = 4
SP_SIZE = 2
WIDTH = 40  # make_samples' longest row is shorter


class SequenceCollator(PaddingCollator):
    """Right-pads to a multiple of the sequence-parallel size and adds ``position_ids`` (Ulysses needs both).

    ``padding``: ``"right"`` (the mask dropped: no real token sees a pad), ``"right-mask"`` (the mask kept, as a
    tokenizer's collator gives it), ``"left"`` (padded on the left as with ``padding_side="left"``, the mask kept:
    Ulysses drops it inside attention, so real tokens would attend to the padding; GradAccTrainer refuses it)."""

    def __init__(self, padding: str = "right") -> None:
        self.padding = padding

    def __call__(self, samples):
        batch = super().__call__(samples)
        width = batch["input_ids"].shape[1]
        # One width for every micro-batch: the adapter all-gathers each rank's batch, and gloo needs equal shapes.
        extra = WIDTH - width
        if extra:
            pad = lambda t, v: torch.nn.functional.pad(t, (0, extra), value=v)  # noqa: E731
            batch["input_ids"] = pad(batch["input_ids"], self.pad_token_id)
            batch["attention_mask"] = pad(batch["attention_mask"], 0)
            if batch["labels"].dim() == 2:  # a token-level head's labels (a classifier's are one per row)
                batch["labels"] = pad(batch["labels"], self.ignore_index)
        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]).clone()
        if self.padding == "left":  # every row's padding moved in front of its tokens; positions stay 0 .. WIDTH - 1
            pads = (batch["attention_mask"] == 0).sum(1).tolist()
            for key in ("input_ids", "attention_mask", "labels"):
                batch[key] = torch.stack([row.roll(n) for row, n in zip(batch[key], pads, strict=True)])
        elif self.padding == "right":  # causal attention: no real token sees a pad; Ulysses drops the mask anyway
            batch.pop("attention_mask")
        return batch


def parallelism_config() -> ParallelismConfig:
    # accelerate sizes DeepSpeed's train_batch_size by `data_parallel_size`: the data ranks beside the sequence group
    return ParallelismConfig(
        dp_replicate_size=world_size() // SP_SIZE,
        sp_size=SP_SIZE,
        sp_backend="deepspeed",
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
    )


def run(trainer_name: str, batch: int, task: str = "causal_lm", *, padding: str = "right") -> dict[str, Any]:
    # One step: GRAD_ACC micro-batches of the adapter = GRAD_ACC / SP_SIZE batches from each of the world ranks
    num_samples = world_size() * batch * GRAD_ACC // SP_SIZE
    if task == "causal_lm":
        base = build_tiny_model("causal_lm")
    else:  # a Llama sequence classifier (sdpa), on the causal LM's config
        from transformers import LlamaForSequenceClassification

        from hf_gradacc.testing.tiny import NUM_LABELS

        config = build_tiny_model("causal_lm").config
        config.num_labels = NUM_LABELS
        torch.manual_seed(1)
        base = LlamaForSequenceClassification(config)
    base.config._attn_implementation = "sdpa"
    samples = make_samples(task, num_samples, seed=0)
    reference = reference_gradients(base, samples, task, PaddingCollator())
    model = copy.deepcopy(base)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = one_step_args(
        tempfile.mkdtemp(prefix="sp_case_"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=GRAD_ACC,
        args_class=GradAccConfig if trainer_name == "gradacc" else TrainingArguments,
        use_cpu=False,
        parallelism_config=parallelism_config(),
    )
    cls = GradAccTrainer if trainer_name == "gradacc" else Trainer
    budget = Budget()  # every collective of the step, by who asked (the library's own: its count and its flag)
    stats = TokenStatsCallback(keep_history=True)  # the step's samples as the library logs them
    trainer = cls(model=model, args=args, train_dataset=ListDataset(samples), data_collator=SequenceCollator(padding),
                  callbacks=[budget, stats])
    budget.trainer = trainer
    with budget, one_sequence_parallel_set_up():  # undone after: `--check` sets Ulysses up again in this process
        trainer.train()
    module = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    update = {n: initial[n] - p.detach().float() for n, p in module.named_parameters()}
    cmp = compare(update, reference)
    return {
        "relative_error": cmp.relative_error,
        "norm_ratio": cmp.norm_ratio,
        "cosine": cmp.cosine,
        "global_step": trainer.state.global_step,
        "num_unchanged": sum(int(bool((u == 0).all())) for u in update.values()),
        "steps": budget.per_step,
        "num_samples": num_samples,
        "step_samples": [step.samples for step in stats.history],
    }


def run_check() -> dict[str, Any]:
    """`hf-gradacc check` (every built-in head) in this launch, after the case: its exit status, report and JSON.

    It reads the sequence-parallel size from the launch's accelerate config (``sp_zero2_cpu.yaml``), as users run it;
    it tears the process group down at its end, so it runs last.
    """
    import contextlib
    import io
    import json

    from hf_gradacc.commands.hf_gradacc_cli import main as cli

    report = f"{tempfile.mkdtemp(prefix='check_sp_')}/check.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli(["check", "--json", report])
    payload: dict[str, Any] = {"status": status, "stdout": printed.getvalue()}
    if rank() == 0:
        with open(report) as f:
            payload["json"] = json.load(f)
    return payload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=("stock", "gradacc"), required=True)
    parser.add_argument("--batch", type=int, default=PER_DEVICE_BATCH)
    parser.add_argument("--tasks", default="causal_lm", help="comma-separated: causal_lm, sequence_classification")
    parser.add_argument("--check", action="store_true", help="then `hf-gradacc check` (needs sp_zero2_cpu.yaml)")
    parser.add_argument("--paddings", default="right", help="comma-separated: right, right-mask, left (one run each)")
    opts = parser.parse_args()
    for task, padding in [(t, p) for t in opts.tasks.split(",") for p in opts.paddings.split(",")]:
        try:
            payload = {"outcome": "trained", **run(opts.trainer, opts.batch, task, padding=padding)}
        except Exception as err:
            payload = {
                "outcome": "error",
                "error_type": type(err).__name__,
                "error": str(err)[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
        name = opts.trainer if task == "causal_lm" else f"{opts.trainer}-{task}"
        name = name if padding == "right" else f"{name}-{padding}"
        write_result(name, payload)
        if rank() == 0:
            print(f"[sequence_parallel_cases] {name}: {payload}", flush=True)
    if opts.check:
        try:
            payload = run_check()
        except Exception as err:
            payload = {"status": None, "error": f"{type(err).__name__}: {err}"[:2000],
                       "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
        write_result("check", payload)
    finish_worker()


if __name__ == "__main__":
    main()
