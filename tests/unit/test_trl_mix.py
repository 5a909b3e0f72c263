"""The TRL-first mix on one process: ``class T(SFTTrainer, GradAccTrainer)``. TRL's ``compute_loss`` runs in front of
the mixin's and, on one process, returns the micro-batch's mean over its completion tokens (the mixin passes the
micro-batch's own count as ``num_items_in_batch``): the step is exact. On 2 ranks the same mix is refused
(tests/distributed/test_trl_mix.py).

TRL 1.9 to 1.14 compute SFT's loss through ``Trainer.compute_loss``, i.e. the MIXIN's in this mix: with their default
``loss_type="chunked_nll"`` the model returns no logits and the mixin's built-in loss stops at the first micro-batch
(GradAccLossError, below); with ``loss_type="nll"`` the step is exact. hf_gradacc.trl.GradAccSFTTrainer is exact with
either (tests/unit/test_trl.py)."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_gradacc import GradAccLossError, GradAccTrainer  # noqa: E402
from hf_gradacc.compat import installed_version, trl_at_least  # noqa: E402
from hf_gradacc.testing.one_step import one_step_args  # noqa: E402
from hf_gradacc.testing.reference import compare  # noqa: E402
from hf_gradacc.testing.tiny import build_tiny_model  # noqa: E402
from hf_gradacc.testing.trl_steps import (  # noqa: E402
    sft_reference,
    sft_rows,
    uneven_batch_sizes,
    with_batch_layout,
    word_tokenizer,
)


class TRLFirst(SFTTrainer, GradAccTrainer):
    pass


# TRL < 1.15's default SFT loss (`chunked_nll`) returns no logits to the mixin's built-in loss: "nll" there.
LOSS = {} if trl_at_least("1.15") else {"loss_type": "nll"}


def _mix_step(tmp_path, **config):
    model = build_tiny_model("causal_lm", seed=0)
    rows = sft_rows(7)  # micro-batches of 2 + 2 + 2 + 1
    trained = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in trained.named_parameters()}
    args = one_step_args(
        str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=SFTConfig, bf16=False,
        completion_only_loss=True, max_length=None, **config,
    )  # fmt: skip
    trainer = with_batch_layout(TRLFirst, uneven_batch_sizes(2, 4))(
        model=trained, args=args, train_dataset=Dataset.from_list(rows), processing_class=word_tokenizer()
    )
    trainer.train()
    update = {n: initial[n] - p.detach() for n, p in trained.named_parameters()}
    return update, sft_reference(model, rows)


def test_the_trl_first_mix_is_exact_on_one_process(tmp_path) -> None:
    update, reference = _mix_step(tmp_path, **LOSS)
    assert compare(update, reference.grads).relative_error <= 1e-5


@pytest.mark.skipif(
    trl_at_least("1.15"),
    reason=f"trl {installed_version('trl')} computes SFT's loss itself (fused LM head, >= 1.15): exact above",
)
def test_the_trl_first_mix_with_trl_chunked_loss_stops_at_its_first_micro_batch(tmp_path) -> None:
    """TRL 1.9 to 1.14's default ``chunked_nll`` patches the model's forward to return a loss without logits, which the
    mixin's built-in loss cannot re-weight: stopped with GradAccLossError (not a wrong step). Not refused at
    construction (the mix is GradAccTrainer's, not hf_gradacc.trl's): use GradAccSFTTrainer, or ``loss_type="nll"``."""
    with pytest.raises(GradAccLossError, match="no `logits`"):
        _mix_step(tmp_path)
