"""Re-fit the cost model of ``fused_lm_head=None`` (:mod:`hf_gradacc.fused.choice`): time the LM head's loss both
ways over a grid of shapes, fit each way's factors, and print (or ``--write``) the ``FACTORS`` block.

    python benchmarks/fused_choice_fit.py                        # CPU, float32, the default grid; prints the block
    python benchmarks/fused_choice_fit.py --write --json fit.json   # rewrites hf_gradacc/fused/choice.py's block

Each shape ``rows x hidden x vocab`` runs forward + backward (gradients with respect to the hidden rows and the head's
weight) of the SUM cross-entropy: the full logits (``hidden @ weight.T``, the float32 upcast, ``F.cross_entropy``)
and hf_gradacc's tiles (``fused_cross_entropy_sum``), ``--repeats`` times after one warm-up, timed in process CPU
time with ONE torch thread (a busy machine does not inflate it; wall time does not enter the fit). Each way's factors
are the non-negative least-squares fit of its terms (see the module docstring) to the median times, relative errors
weighted alike; the script prints each shape's measured and predicted ratio and the worst relative error of the fit.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_gradacc.fused.choice import CACHED_LOGITS, CostFactors, tiles_of  # noqa: E402
from hf_gradacc.fused.head import fused_cross_entropy_sum  # noqa: E402

GRID_VOCABS = (96, 2048, 32000, 151936)
GRID_HIDDENS = (64, 512)
GRID_ROWS = (128, 512, 2048)
MAX_WORK = 8e9  # rows x hidden x vocab per shape (about 50 GFLOP forward + backward)
MODULE = Path(__file__).resolve().parents[1] / "hf_gradacc" / "fused" / "choice.py"


def _cpu_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def measure(rows: int, hidden: int, vocab: int, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """``(full, fused)`` CPU seconds of forward + backward at one shape."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, hidden, generator=gen) * 0.5).to(dtype).requires_grad_()
    head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)

    def full() -> None:
        x.grad = head.weight.grad = None
        F.cross_entropy(head(x).float(), targets, reduction="sum").backward()

    def fused() -> None:
        x.grad = head.weight.grad = None
        fused_cross_entropy_sum(x, head, targets).backward()

    return _cpu_seconds(full, repeats), _cpu_seconds(fused, repeats)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by elimination: solve, drop the most negative factor, repeat."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def features(rows: float, hidden: int, vocab: int) -> tuple[list[float], list[float]]:
    """Each way's terms, in :class:`CostFactors` order (full: matmul, softmax, spill, call; fused: matmul, softmax,
    sweep, buffer, call)."""
    full = [rows * hidden * vocab, rows * vocab, max(0.0, rows * vocab - CACHED_LOGITS), 1.0]
    fused = [rows * hidden * vocab, rows * vocab, tiles_of(rows, hidden, vocab) * hidden * vocab, hidden * vocab, 1.0]
    return full, fused


def fit(samples: list[dict], label: str) -> CostFactors:
    full_a, fused_a, full_t, fused_t = [], [], [], []
    for s in samples:
        fa, ga = features(s["rows"], s["hidden"], s["vocab"])
        full_a.append([v / s["full"] for v in fa])
        fused_a.append([v / s["fused"] for v in ga])
        full_t.append(1.0)
        fused_t.append(1.0)
    f = nnls(np.array(full_a), np.array(full_t))
    g = nnls(np.array(fused_a), np.array(fused_t))
    return CostFactors(
        full_matmul=float(f[0]), full_softmax=float(f[1]), full_spill=float(f[2]), full_call=float(f[3]),
        fused_matmul=float(g[0]), fused_softmax=float(g[1]), fused_sweep=float(g[2]), fused_buffer=float(g[3]),
        fused_call=float(g[4]),
        fitted_on=label,
    )  # fmt: skip


def block(factors: dict[tuple[str, str], CostFactors]) -> str:
    lines = ["FACTORS: dict[tuple[str, str], CostFactors] = {"]
    for (device, dtype), c in factors.items():
        lines.append(f'    ("{device}", "{dtype}"): CostFactors(')
        for name in CostFactors.__dataclass_fields__:
            value = getattr(c, name)
            lines.append(f'        {name}="{value}",' if isinstance(value, str) else f"        {name}={value:.4g},")
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


def write_block(text: str) -> None:
    source = MODULE.read_text()
    pattern = re.compile(r"(# BEGIN FITTED[^\n]*\n).*?(\n# END FITTED)", re.S)
    if not pattern.search(source):
        raise SystemExit(f"no FITTED block in {MODULE}")
    MODULE.write_text(pattern.sub(lambda m: m.group(1) + text + m.group(2), source))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", default=",".join(map(str, GRID_VOCABS)))
    parser.add_argument("--hiddens", default=",".join(map(str, GRID_HIDDENS)))
    parser.add_argument("--rows", default=",".join(map(str, GRID_ROWS)))
    parser.add_argument("--max_work", type=float, default=MAX_WORK)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="rewrite the FITTED block of hf_gradacc/fused/choice.py")
    parser.add_argument("--json", default=None)
    parser.add_argument("--from_json", default=None, help="re-fit the samples of an earlier --json, measuring nothing")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, opts.dtype)
    samples = json.loads(Path(opts.from_json).read_text())["samples"] if opts.from_json else []
    for vocab in [] if opts.from_json else map(int, opts.vocabs.split(",")):
        for hidden in map(int, opts.hiddens.split(",")):
            for rows in map(int, opts.rows.split(",")):
                if rows * hidden * vocab > opts.max_work:
                    continue
                full, fused = measure(rows, hidden, vocab, dtype, opts.repeats)
                samples.append({"rows": rows, "hidden": hidden, "vocab": vocab, "full": full, "fused": fused})
                print(f"{rows:>6} x {hidden:>4} x {vocab:>6}: full {full * 1e3:9.2f} ms  fused {fused * 1e3:9.2f} ms"
                      f"  ({fused / full:.2f}x)", flush=True)  # fmt: skip
    label = f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, 1 thread, {len(samples)} shapes"
    factors = fit(samples, label)
    from hf_gradacc.fused.choice import HeadShape, predict_seconds

    worst = 0.0
    for s in samples:
        shape = HeadShape(counted=s["rows"], positions=s["rows"], hidden=s["hidden"], vocab=s["vocab"])
        pf, pg = predict_seconds(shape, factors)
        worst = max(worst, abs(pf / s["full"] - 1), abs(pg / s["fused"] - 1))
        s["predicted_ratio"] = pg / pf
        print(f"{s['rows']:>6} x {s['hidden']:>4} x {s['vocab']:>6}: measured {s['fused'] / s['full']:.2f}x, "
              f"predicted {pg / pf:.2f}x")  # fmt: skip
    print(f"worst relative error of a predicted time: {worst:.2f}")
    text = block({("cpu", opts.dtype): factors})
    print(text)
    if opts.write:
        write_block(text)
        print(f"written to {MODULE}")
    result = {"samples": samples, "factors": factors.__dict__ if hasattr(factors, "__dict__") else None,
              "worst_relative_error": worst}  # fmt: skip
    if opts.json:
        result["factors"] = {k: getattr(factors, k) for k in CostFactors.__dataclass_fields__}
        Path(opts.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
