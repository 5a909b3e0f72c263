"""The TRL-first mix on one process: ``class T(SFTTrainer, GradAccTrainer)``. TRL's ``compute_loss`` runs in front of
the mixin's and, on one process, returns the micro-batch's mean over its completion tokens (the mixin passes the
micro-batch's own count as ``num_items_in_batch``): the step is exact. On 2 ranks the same mix is refused
(tests/distributed/test_trl_mix.py)."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_gradacc import GradAccTrainer  # noqa: E402
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


def test_the_trl_first_mix_is_exact_on_one_process(tmp_path) -> None:
    model = build_tiny_model("causal_lm", seed=0)
    rows = sft_rows(7)  # micro-batches of 2 + 2 + 2 + 1
    reference = sft_reference(model, rows)
    trained = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in trained.named_parameters()}
    args = one_step_args(
        str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=SFTConfig, bf16=False,
        completion_only_loss=True, max_length=None,
    )  # fmt: skip
    trainer = with_batch_layout(TRLFirst, uneven_batch_sizes(2, 4))(
        model=trained, args=args, train_dataset=Dataset.from_list(rows), processing_class=word_tokenizer()
    )
    trainer.train()
    update = {n: initial[n] - p.detach() for n, p in trained.named_parameters()}
    assert compare(update, reference.grads).relative_error <= 1e-5
