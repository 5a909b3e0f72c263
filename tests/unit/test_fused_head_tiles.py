"""The plain linear head's tiles (``hf_gradacc.fused.head._linear_tiles``) against the full logits in float64: few
rows through a large vocabulary, rows not divisible by the tile, one row, no counted row, a tile of ignored rows,
bias and logit scale, bf16; and the tile size chosen from the shape (``rows_per_tile``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_gradacc.fused.head as fused_head
from hf_gradacc.fused.head import LogitTransform, fused_cross_entropy_sum, rows_per_tile

TOLERANCE = 1e-5  # float32 against float64, relative (norm); float32 rounding is ~1e-7 here


def _head(hidden: int, vocab: int, *, bias: bool = False, dtype: torch.dtype = torch.float32) -> torch.nn.Linear:
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        head.weight.mul_(4.0)  # logits of a few units: the softmax is far from uniform
    return head.to(dtype)


def _float64(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> list:
    """Loss and gradients (hidden, weight[, bias]) of the full logits in float64."""
    h = hidden.detach().double().requires_grad_(True)
    params = [p.detach().double().requires_grad_(True) for p in head.parameters()]
    logits = F.linear(h, *params) * scale
    loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    loss.backward()
    return [loss.detach(), h.grad] + [p.grad for p in params]


def _fused(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, **kwargs) -> list:
    h = hidden.detach().clone().requires_grad_(True)
    for p in head.parameters():
        p.grad = None
    loss = fused_cross_entropy_sum(h, head.forward, targets, **kwargs)  # the bound forward: the hand-written tiles
    loss.backward()
    return [loss.detach(), h.grad] + [p.grad for p in head.parameters()]


def _relative(ours: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    return float((ours.double() - exact).norm() / exact.norm().clamp_min(1e-30))


CASES = {  # rows, hidden, vocabulary, tile rows (None: chosen from the shape), bias, logit scale
    "few_rows_large_vocab": (6, 16, 40000, None, False, 1.0),
    "rows_not_divisible_by_the_tile": (70, 24, 3001, 32, False, 1.0),  # 32 + 32 + 6
    "one_row": (1, 24, 3001, None, False, 1.0),
    "bias_and_scale_several_tiles": (45, 24, 3001, 16, True, 0.7),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tiles_equal_the_float64_full_logits(name: str) -> None:
    rows, width, vocab, tile, bias, scale = CASES[name]
    head = _head(width, vocab, bias=bias)
    hidden = torch.randn(rows, width)
    targets = torch.randint(0, vocab, (rows,))
    if rows > 1:
        targets[1::5] = -100  # ignored rows inside the tiles (the first row counts)
    ours = _fused(head, hidden, targets, tile_rows=tile, transform=LogitTransform(scale=scale))
    exact = _float64(head, hidden, targets, scale)
    for what, a, b in zip(["loss", "hidden", "weight", "bias"], ours, exact):
        assert _relative(a, b) <= TOLERANCE, (name, what, _relative(a, b))


def test_a_tile_of_ignored_rows_and_no_row_at_all_give_zero_loss_and_zero_gradients() -> None:
    """Rows 16-31 all ignored (a whole tile), and a call with no row: every gradient exists and the ignored rows'
    and the empty call's are exactly zero; the counted rows are exact."""
    head = _head(8, 500, bias=True)
    hidden = torch.randn(40, 8)
    targets = torch.randint(0, 500, (40,))
    targets[16:32] = -100
    ours = _fused(head, hidden, targets, tile_rows=16)
    assert float(ours[1][16:32].abs().max()) == 0.0
    for what, a, b in zip(["loss", "hidden", "weight", "bias"], ours, _float64(head, hidden, targets)):
        assert _relative(a, b) <= TOLERANCE, (what, _relative(a, b))
    empty = _fused(head, hidden[:0], targets[:0])
    assert float(empty[0]) == 0.0 and empty[1].shape == (0, 8)
    assert [tuple(g.shape) for g in empty[2:]] == [(500, 8), (500,)]
    assert all(float(g.abs().max()) == 0 for g in empty[2:])
    ignored = _fused(head, hidden[16:32], targets[16:32])
    assert float(ignored[0]) == 0.0 and all(float(g.abs().max()) == 0 for g in ignored[1:])


def test_bf16_tiles_are_as_close_to_float64_as_the_bf16_full_logits() -> None:
    """A bf16 head, few rows through a vocabulary of 20,000 in 13 tiles (the last partial): the tiles' gradients are
    no further from float64 than the full logits' bf16 gradients (the weight's is summed over the tiles in float32;
    summed in bf16 it is further)."""
    head = _head(32, 20000, dtype=torch.bfloat16)
    hidden = torch.randn(200, 32, dtype=torch.bfloat16)
    targets = torch.randint(0, 20000, (200,))
    targets[::7] = -100
    ours = _fused(head, hidden, targets, tile_rows=16)
    h = hidden.clone().requires_grad_(True)
    head.weight.grad = None
    F.cross_entropy(head(h).float(), targets, reduction="sum").backward()
    full = [h.grad, head.weight.grad]
    exact = _float64(head, hidden, targets)
    for a, b, e in zip(ours[1:], full, exact[1:]):
        assert a.dtype == torch.bfloat16
        assert _relative(a, e) <= 1.05 * _relative(b, e), (_relative(a, e), _relative(b, e))


def test_the_tile_is_chosen_from_the_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few rows through a large weight: tiles widened from the logit budget to ~sqrt(rows * hidden / 4), capped at
    half the hidden size or a quarter of the rows; a small weight (in cache) keeps the logit budget. The default call
    uses that tile and stays exact."""
    assert rows_per_tile(512, 512, 151936) == 256  # the logit budget alone: 55
    assert fused_head.tile_rows_for(151936) == 55
    assert rows_per_tile(512, 2048, 32000) == 512  # one tile
    assert rows_per_tile(8192, 512, 32000) == 1024
    assert rows_per_tile(512, 512, 32000) == 262  # the budget already gives more
    assert rows_per_tile(70, 32, 128) == fused_head.tile_rows_for(128)  # in cache: never narrower or wider
    steps: list[int] = []
    original = fused_head._linear_tiles
    monkeypatch.setattr(fused_head, "_linear_tiles", lambda *a: steps.append(a[5]) or original(*a))
    monkeypatch.setattr(fused_head, "tile_rows_for", lambda vocab_size, tile_elements=0: 3)
    monkeypatch.setattr(fused_head, "WIDEN_ABOVE_ELEMENTS", 0)
    head = _head(64, 3001)
    hidden = torch.randn(70, 64)
    targets = torch.randint(0, 3001, (70,))
    ours = _fused(head, hidden, targets)
    assert steps == [32]  # min(70, max(64 // 2, 70 // 4), isqrt(70 * 64 // 4) = 33): tiles of 32, 32 and 6 rows
    for a, b in zip(ours, _float64(head, hidden, targets)):
        assert _relative(a, b) <= TOLERANCE
