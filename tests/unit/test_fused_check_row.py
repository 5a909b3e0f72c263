"""The fused LM head's start-up check runs the model's own full-logits forward on ONE row; that row is cut after its
first CHECK_TARGETS counted targets (hf_gradacc/fused/head.py, `check_row`), so a packed or regrouped micro-batch of long
prompts does not project its whole width at full vocabulary (docs/benchmarks.md, vocabulary 151,936)."""

from __future__ import annotations

import pytest
import torch

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.fused.head import CHECK_TARGETS, check_row
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import VOCAB_SIZE, build_tiny_model

TOLERANCE = 1e-5


def _completion_only(num: int, prompt: int, completion: int) -> list[dict]:
    """Samples of a long prompt (ignored) and a completion of at least CHECK_TARGETS + 1 counted targets."""
    g = torch.Generator().manual_seed(5)
    samples = []
    for i in range(num):
        n_prompt, n_completion = prompt + 7 * (i % 3), completion + 5 * (i % 4)
        ids = torch.randint(2, VOCAB_SIZE, (n_prompt + n_completion,), generator=g).tolist()
        samples.append({"input_ids": ids, "labels": [-100] * n_prompt + ids[n_prompt:]})
    return samples


@pytest.mark.parametrize("layout", ["packed", "regrouped"])
def test_the_head_projects_counted_targets_and_a_check_row_cut_after_its_first_targets(layout: str) -> None:
    samples = _completion_only(8, prompt=40, completion=CHECK_TARGETS + 4)
    model = build_tiny_model("causal_lm")
    model.config._attn_implementation = "sdpa"
    full: list[tuple[int, int]] = []  # (rows, width) of every full-logits call: the check's own-loss forward
    fused: list[int] = []  # rows the fused tiles projected
    widths: list[int] = []  # micro-batch widths the training forwards saw

    class Counting(GradAccTrainer):
        def create_optimizer(self, *args, **kwargs):
            def count(_module, args_, output):
                if torch._C._current_graph_task_id() != -1:
                    return  # a backward recomputation
                rows = getattr(output, "fused_rows", None)
                if rows is None:
                    full.append(tuple(args_[0].shape[:2]))
                else:
                    fused.append(int(rows))
                    widths.append(int(args_[0].shape[1]))

            self.model.get_output_embeddings().register_forward_hook(count)
            return super().create_optimizer(*args, **kwargs)

    extra = (
        {"pack_micro_batches": True, "max_tokens_per_micro_batch": 400}
        if layout == "packed"
        else {"regroup_micro_batches": True}
    )
    args = one_step_args(per_device_train_batch_size=4, gradient_accumulation_steps=2, args_class=GradAccConfig,
                         fused_lm_head=True, **extra)  # fmt: skip
    update, _ = one_step_update(Counting, model, samples, args)
    counted = sum(len(s["labels"]) - 1 - s["labels"][1:].count(-100) for s in samples)
    # training: one fused call per micro-batch, exactly the counted targets; the check: its fused row adds
    # CHECK_TARGETS, its own-loss forward one row: a prompt and CHECK_TARGETS + 1 positions, not the whole row
    assert sum(fused) == counted + CHECK_TARGETS
    assert len(full) == 1 and full[0][0] == 1
    longest_prompt = max(s["labels"].count(-100) for s in samples)
    assert full[0][1] <= longest_prompt + CHECK_TARGETS + 1 < max(widths)  # a packed row holds several samples
    assert compare_with_reference(update, model, samples, "causal_lm").relative_error <= TOLERANCE


def test_the_cut_follows_the_packed_offsets_and_keeps_rows_it_cannot_follow() -> None:
    targets = torch.tensor([[-100, 5, 6, -100, -100, 7, 8, 9, -100]])
    inputs = {
        "input_ids": torch.arange(9)[None],
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]),
        "cu_seq_lens_q": torch.tensor([0, 4, 9], dtype=torch.int32),
        "cu_seq_lens_k": torch.tensor([0, 4, 9], dtype=torch.int32),
        "max_length_q": 5,
        "max_length_k": 5,
    }
    one = check_row(inputs, targets, None, targets.clone(), ignore_index=-100, num_targets=3)
    # the third counted target is at position 5: the model sees positions 0..6 and no label past the cut
    assert one.inputs["input_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6]]
    assert one.inputs["cu_seq_lens_q"].tolist() == [0, 4, 7] and one.inputs["max_length_k"] == 4
    assert one.targets.tolist() == [[-100, 5, 6, -100, -100, 7, -100]] == one.shift_labels.tolist()
    # the first row with a counted target is the one cut; a key the cut cannot follow (images) keeps the whole batch
    two = torch.tensor([[-100, -100, -100, -100, -100], [3, -100, 4, 5, -100]])
    ids = torch.ones(2, 5, dtype=torch.long)
    assert check_row({"input_ids": ids}, two, None, None, ignore_index=-100, num_targets=2).targets.tolist() == [
        [3, -100, 4, -100]
    ]
    assert check_row({"input_ids": ids, "pixel_values": torch.ones(2, 3, 4, 4)}, two, None, None, ignore_index=-100) is None
