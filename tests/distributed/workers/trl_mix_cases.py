"""Worker of ``tests/distributed/test_trl_mix.py``: the "TRL-first" mix a TRL user writes by hand,
``class T(SFTTrainer, GradAccTrainer)``, on 2 CPU ranks (gloo), one SGD(lr=1) step over 14 prompt-completion rows
(2 + 2 + 2 + 1 per rank). TRL's ``compute_loss`` then runs in front of the mixin's and returns a loss it has already
normalised for accumulation; the mixin must either train it exactly or refuse it, on both ranks alike, never hang.
Each rank writes what happened ("trl_mix"): the error's class and message, or the update's relative error against
the float64 reference over all 14 rows.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import traceback

import torch

from hf_gradacc import GradAccTrainer
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.reference import compare
from hf_gradacc.testing.tiny import build_tiny_model
from hf_gradacc.testing.trl_steps import sft_reference, sft_rows, uneven_batch_sizes, with_batch_layout, word_tokenizer
from tests.distributed.workers._common import finish_worker, world_size, write_result

BS, GA = 2, 4


def run() -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    class TRLFirst(SFTTrainer, GradAccTrainer):
        pass

    torch.set_num_threads(1)
    layout = uneven_batch_sizes(BS, GA, world_size())
    rows = sft_rows(sum(layout))
    model = build_tiny_model("causal_lm", seed=0)
    reference = sft_reference(model, rows)
    trained = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in trained.named_parameters()}
    args = one_step_args(
        tempfile.mkdtemp(prefix="hf_gradacc_trl_mix_"), per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
        args_class=SFTConfig, bf16=False, completion_only_loss=True, max_length=None, ddp_backend="gloo",
        ddp_timeout=60, seed=0,
    )  # fmt: skip
    trainer = with_batch_layout(TRLFirst, layout)(
        model=trained, args=args, train_dataset=Dataset.from_list(rows), processing_class=word_tokenizer()
    )
    try:
        trainer.train()
    except Exception as error:  # the expected refusal: reported, then the worker ends normally
        return {"error_type": type(error).__name__, "bases": [c.__name__ for c in type(error).__mro__], "message": str(error)}
    update = {n: initial[n] - p.detach() for n, p in trained.named_parameters()}
    return {"relative_error": compare(update, reference.grads).relative_error}


def main() -> None:
    try:
        payload = run()
    except BaseException:
        write_result("trl_mix", {"crash": traceback.format_exc()})
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    write_result("trl_mix", payload)
    finish_worker()


if __name__ == "__main__":
    main()
