"""A peer lost in a collective that `Trainer.train` runs outside an optimizer step (the logged loss's gather,
evaluation, a callback) ends in the library's :class:`~hf_gradacc.GradAccDistributedError` naming the step, the rank,
``ddp_timeout`` and the way back (``resume_from_checkpoint=True``), with torch's error as its cause; any other error
passes unchanged. Inside a step the same failure already names the step and micro-batch (``collective_failure``).

On one process the peer cannot really be lost: a callback raises what gloo raises (a ``DistBackendError`` and the
``RuntimeError`` text gloo gives when the peer closed its socket). The real loss of a peer is
tests/distributed/test_elastic.py (torchrun elastic, one agent killed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from transformers import TrainerCallback

from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccDistributedError, GradAccTrainer
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

BS, GA, STEPS, FAIL_AT = 2, 2, 3, 2


class FailsOnLog(TrainerCallback):
    """Raises ``error`` from ``on_log`` after optimizer step ``FAIL_AT``: where the Trainer's own gather runs."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def on_log(self, args, state, control, **kwargs):
        if state.global_step == FAIL_AT:
            raise self.error


def _train(tmp_path: Path, error: BaseException) -> None:
    args = GradAccConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA,
        max_steps=STEPS,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        ddp_timeout=30,
    )
    trainer = GradAccTrainer(
        model=build_tiny_model("causal_lm"),
        args=args,
        train_dataset=ListDataset(make_samples("causal_lm", BS * GA * STEPS, seed=1)),
        data_collator=PaddingCollator(),
        callbacks=[FailsOnLog(error)],
    )
    trainer.train()


@pytest.mark.parametrize(
    "error",
    [
        dist.DistBackendError("[gloo] Connection closed by peer [127.0.0.1]:29500"),
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:6019"),
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms"),
    ],
    ids=["DistBackendError", "closed-by-peer", "timed-out"],
)
def test_a_peer_lost_outside_the_step_is_the_librarys_error(tmp_path, error):
    with pytest.raises(GradAccDistributedError) as raised:
        _train(tmp_path, error)
    message = str(raised.value)
    assert f"After optimizer step {FAIL_AT} on rank 0" in message, message
    assert "`ddp_timeout` (30 s)" in message and "`resume_from_checkpoint=True`" in message, message
    assert raised.value.__cause__ is error  # torch's own error kept as the cause


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA out of memory"),
        ValueError("a callback's own bug"),
        GradAccConfigError("the library's own"),
        GradAccDistributedError("Saving the checkpoint of step 2: ... Connection closed by peer"),  # named already
    ],
    ids=["other-RuntimeError", "ValueError", "GradAccError", "GradAccDistributedError"],
)
def test_other_errors_pass_unchanged(tmp_path, error):
    with pytest.raises(type(error)) as raised:
        _train(tmp_path, error)
    assert raised.value is error
