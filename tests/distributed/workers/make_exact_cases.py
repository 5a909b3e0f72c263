"""DDP worker: ``make_exact`` on Trainer subclasses "a framework" built, on CPU ranks (gloo), against the float64
full-batch reference over both ranks' samples; and ``compute_loss_func`` on 2 ranks.

Started on 2 ranks by ``tests/distributed/test_make_exact_ddp.py`` through ``tests/distributed/launcher.py``:

    python tests/distributed/workers/make_exact_cases.py --cases make_exact_sequence_classification

The training and measuring are ``ddp_cases.train_and_measure`` (sequential sampling, round-robin shards, SGD(lr=1) for
one step, every rank's update compared with the reference). Each case writes ``<case>.rank<r>.json``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from _common import run_named_cases
from ddp_cases import BS, GA, SequentialShardMixin, W, case_moe, train_and_measure
from transformers import Trainer

from hf_gradacc import IGNORE_INDEX, GradAccMixin, GradAccTrainer, make_exact
from hf_gradacc.testing.one_step import one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import PaddingCollator, build_tiny_model, make_samples

FACTOR = 3.0


# ---------------------------------------------------------------------------------------------- a framework's trainers
class FrameworkClassifierTrainer(SequentialShardMixin, Trainer):
    """The stock loss, a `log` override of its own."""

    def log(self, logs, start_time=None):
        logs["framework_marker"] = 1.0
        super().log(logs, start_time)


class FrameworkMeanTrainer(SequentialShardMixin, Trainer):
    """compute_loss returning the model's own loss: the mean over the micro-batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class FrameworkSuperTrainer(SequentialShardMixin, Trainer):
    """compute_loss through the stock one (which, with `model_accepts_loss_kwargs` and the default
    `average_tokens_across_devices`, multiplies by the number of processes when given `num_items_in_batch`)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


class SequentialGradAccTrainer(SequentialShardMixin, GradAccTrainer):
    pass


def made_exact(trainer_class: type[Trainer]) -> Callable[..., Trainer]:
    def build(**kwargs: Any) -> Trainer:
        trainer = trainer_class(**kwargs)
        assert make_exact(trainer) is trainer
        return trainer

    build.__name__ = f"make_exact({trainer_class.__name__})"
    return build


def triple_ce(outputs, labels, num_items_in_batch=None):
    """3 x next-token cross-entropy, the transformers convention: the token sum over `num_items_in_batch`."""
    logits = outputs.logits
    total = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX,
        reduction="sum",
    )  # fmt: skip
    return FACTOR * total / num_items_in_batch


# ---------------------------------------------------------------------------------------------- cases
def case_make_exact(trainer_class: type[Trainer], task: str) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        samples = make_samples(task, BS * GA * W, seed=3)
        exact, trainer = train_and_measure(made_exact(trainer_class), task, samples)
        exact.update(
            is_mixin=isinstance(trainer, GradAccMixin),
            class_name=type(trainer).__name__,
            dp_world_size=trainer.backend.mesh.dp_world_size,
            backend=trainer.backend.name,
        )
        stock, _ = train_and_measure(trainer_class, task, samples)
        return {"exact": exact, "stock": stock}

    return run


def case_compute_loss_func() -> dict[str, Any]:
    """GradAccTrainer(compute_loss_func=3 x CE): the update over 3 against the reference over both ranks' samples."""
    task = "causal_lm"
    samples = make_samples(task, BS * GA * W, seed=3)
    model = build_tiny_model(task, seed=0)
    args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA, use_cpu=True,
                         ddp_backend="gloo", ddp_timeout=120, seed=0)  # fmt: skip
    update, trainer = one_step_update(
        SequentialGradAccTrainer, model, samples, args, trainer_kwargs={"compute_loss_func": triple_ce}
    )
    reference = reference_gradients(model, samples, task, PaddingCollator())
    scaled = compare({n: u / FACTOR for n, u in update.items()}, reference)
    return {
        "relative_error": scaled.relative_error,
        "norm_ratio_unscaled": compare(update, reference).norm_ratio,
        "num_processes": trainer.accelerator.num_processes,
        "model_wrapped": type(trainer.model_wrapped).__name__,
    }


def case_make_exact_moe(family: str) -> Callable[[], dict[str, Any]]:
    """A framework's compute_loss returning a mixture-of-experts model's `outputs.loss` (CE mean + coef x aux), made
    exact: the router term weighted by routed tokens over both ranks; the last micro-batch of rank 1 is short (the
    measurement of ddp_cases.case_moe, with the trainer made exact after construction)."""
    return case_moe(family, trainer_class=made_exact(FrameworkMeanTrainer))


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "make_exact_moe_mixtral": case_make_exact_moe("mixtral"),
    "make_exact_moe_qwen3_moe": case_make_exact_moe("qwen3_moe"),
    "make_exact_sequence_classification": case_make_exact(FrameworkClassifierTrainer, "sequence_classification"),
    "make_exact_mean_causal_lm": case_make_exact(FrameworkMeanTrainer, "causal_lm"),
    "make_exact_mean_sequence_classification": case_make_exact(FrameworkMeanTrainer, "sequence_classification"),
    "make_exact_super_causal_lm": case_make_exact(FrameworkSuperTrainer, "causal_lm"),
    "compute_loss_func": case_compute_loss_func,
}


def main() -> None:
    run_named_cases(CASES, __doc__)


if __name__ == "__main__":
    main()
