"""The log line's one collective (issue 24, the collective budget): the loss terms' means and a mixture-of-experts
model's expert load (``moe/load_max_over_mean``) leave every rank in ONE gather, two simulated ranks here."""

from __future__ import annotations

import pytest
import torch

from hf_gradacc.moe_balance import LOAD_KEY, MoeLoadLog, RouterShape, StepRouting
from hf_gradacc.step.window import TermLog


def _rank_log(aux: list[float], counts: list[torch.Tensor]) -> TermLog:
    """A rank's log after ``len(aux)`` steps: the aux term's per-step totals and the steps' ``[layers, experts + 1]``
    routing counts."""
    log = TermLog(moe=MoeLoadLog())
    for value, step_counts in zip(aux, counts, strict=True):
        log.totals["aux"] = log.totals.get("aux", torch.tensor(0.0)) + torch.tensor(value)
        log.num_steps += 1
        log.moe.add(StepRouting(shape=RouterShape(num_experts=3, top_k=1), local_counts=step_counts))
    return log


def _counts(*layers: list[int]) -> torch.Tensor:
    return torch.tensor([[*row, sum(row)] for row in layers], dtype=torch.int64)


def test_terms_and_expert_load_leave_in_one_gather():
    rank0 = _rank_log([0.5, 0.25], [_counts([4, 0, 0], [1, 2, 1]), _counts([2, 1, 1], [0, 0, 4])])
    rank1 = _rank_log([0.125, 1.0], [_counts([0, 4, 4], [3, 3, 2]), _counts([1, 1, 6], [4, 4, 0])])
    sent: list[torch.Tensor] = []

    def capture(tensor: torch.Tensor) -> torch.Tensor:  # rank 1's turn: what it sends
        sent.append(tensor.clone())
        return tensor.unsqueeze(0)

    rank1.pop_means(capture, "cpu")
    calls: list[torch.Tensor] = []

    def gather(tensor: torch.Tensor) -> torch.Tensor:  # rank 0's: every rank's row, as Backend.all_gather stacks them
        calls.append(tensor)
        return torch.stack([tensor, sent[0]])

    logs = rank0.pop_means(gather, "cpu")
    assert len(sent) == len(calls) == 1  # one collective per log line on each rank
    # the aux term: per rank, its total over the 2 steps; averaged over the ranks, per step
    assert logs["loss/aux"] == pytest.approx(((0.5 + 0.25) + (0.125 + 1.0)) / 2 / 2, rel=1e-12)
    # the load from both ranks' counts summed, per step: step 1 layer 0 [4, 4, 4], layer 1 [4, 5, 3];
    # step 2 layer 0 [3, 2, 7], layer 1 [4, 4, 4]
    layer0 = (4 / 4 + 7 / 4) / 2
    layer1 = (5 / 4 + 4 / 4) / 2
    assert logs[f"{LOAD_KEY}/layer_0"] == pytest.approx(layer0, rel=1e-12)
    assert logs[f"{LOAD_KEY}/layer_1"] == pytest.approx(layer1, rel=1e-12)
    assert logs[LOAD_KEY] == pytest.approx((layer0 + layer1) / 2, rel=1e-12)
    assert rank0.totals == {} and rank0.num_steps == 0 and rank0.moe.steps == []  # reset for the next line


def test_a_term_without_expert_load_and_a_load_without_terms():
    terms_only = TermLog(moe=MoeLoadLog())
    terms_only.totals, terms_only.num_steps = {"aux": torch.tensor(0.75), "main": torch.tensor(3.0)}, 3
    logs = terms_only.pop_means(lambda t: t.unsqueeze(0), "cpu")
    assert logs == pytest.approx({"loss/aux": 0.25, "loss/main": 1.0}, rel=1e-7)
    load_only = _rank_log([], [])
    load_only.moe.add(StepRouting(shape=RouterShape(num_experts=3, top_k=1), local_counts=_counts([2, 1, 0])))
    assert load_only.pop_means(lambda t: t.unsqueeze(0), "cpu") == pytest.approx(
        {LOAD_KEY: 2.0, f"{LOAD_KEY}/layer_0": 2.0}, rel=1e-12
    )
    nothing = TermLog(moe=MoeLoadLog())
    assert nothing.pop_means(lambda t: pytest.fail("no collective when there is nothing to log"), "cpu") == {}
