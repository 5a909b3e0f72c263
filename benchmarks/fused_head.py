"""The LM head's loss, forward + backward, on CPU: full logits against hf_gradacc's tiles
(:mod:`hf_gradacc.fused.head`) and, on request, torch's chunked ``F.linear_cross_entropy``: CPU time, peak memory,
exactness, as a markdown table.

    python benchmarks/fused_head.py                       # issue 26: five shapes x both .grad states; ~12 min CPU
    python benchmarks/fused_head.py --shapes 512x512x151936 --repeats 5 --markdown head.md --json head.json
    python benchmarks/fused_head.py --methods full_logits,hf_gradacc_tiles,torch_linear_cross_entropy

Shapes are ``rows x hidden x vocabulary`` (rows: the positions whose target counts; every seventh target is
``-100`` and passes through too). Each (method, shape) runs in a fresh process on ONE thread (``OMP_NUM_THREADS=1``,
``MKL_NUM_THREADS=1``, ``torch.set_num_threads(1)``), float32: the loss SUM and its gradients with respect to the
hidden states and the head's weight, ``--repeats`` times after one warm-up.

- **CPU time**: ``time.process_time()`` around each forward + backward (the process's user + system time: page
  faults count, time spent waiting for a busy machine's cores does not). Median and [min-max] over the repeats.
  Wall time is printed beside it but means little on a shared machine.
- **Peak memory**: the rise of the process's resident-set high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``) over the resident set once the inputs exist, over the warm-up and the repeats: torch's
  CPU allocator keeps no statistics and ``tracemalloc`` does not see it.
- **The states of the weight's ``.grad``** (``--states``), side by side: reset to None before each repeat (``first``:
  a first micro-batch, where both methods materialise the float32 weight gradient; the fused head runs inside
  ``fused_into_grad.keeping_buffers()`` as GradAccTrainer's training loop does, so from the second repeat on it writes
  into the buffer kept from the last one: a window after the run's first), the same without keeping the buffer
  (``first_fresh``: the run's first window, or the fused head called outside GradAccTrainer; fused method only) and
  a zeroed one kept (``grad_exists``: micro-batches 2..N of accumulation; the full logits make a temporary gradient
  that autograd adds into it, the fused head adds into it directly: :mod:`hf_gradacc.fused.into_grad`).
- **Exactness**: after the timed runs, the largest relative error of the loss, the hidden states' and the weight's
  gradients against a float64 computation of the full logits.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

METHODS = ("full_logits", "hf_gradacc_tiles", "torch_linear_cross_entropy")
DEFAULT_SHAPES = "512x512x32000,2048x512x32000,8192x512x32000,512x2048x32000,512x512x151936"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise OSError(key)


def _case(rows: int, hidden: int, vocab: int, seed: int, tile_rows: int | None) -> tuple[Any, Any, Any, Any]:
    """One thread; the head, the hidden rows, the targets (every seventh ignored) of a shape, and ``loss_of(method,
    hidden)``: the summed cross-entropy each method computes."""
    import torch
    import torch.nn.functional as F

    from hf_gradacc.fused.head import fused_cross_entropy_sum

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * hidden**-0.5)
    h0 = torch.randn(rows, hidden, generator=g)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[::7] = -100

    def loss_of(method: str, h: torch.Tensor) -> torch.Tensor:
        if method == "full_logits":
            return F.cross_entropy(head(h), targets, ignore_index=-100, reduction="sum")
        if method == "torch_linear_cross_entropy":
            return F.linear_cross_entropy(h, head.weight, targets, reduction="sum", ignore_index=-100,
                                          options=torch.nn.LinearCrossEntropyOptions())  # fmt: skip
        return fused_cross_entropy_sum(h, head.forward, targets, tile_rows=tile_rows)  # as the trainer calls it

    return head, h0, targets, loss_of


def run_one(method: str, rows: int, hidden: int, vocab: int, repeats: int, seed: int, state: str,
            tile_rows: int | None = None) -> dict:  # fmt: skip
    """One (method, shape) in this process: CPU and wall time per repeat, the peak rise, the errors vs float64."""
    import torch
    import torch.nn.functional as F

    from hf_gradacc.fused import into_grad as fused_into_grad
    from hf_gradacc.fused.head import rows_per_tile

    head, h0, targets, loss_of = _case(rows, hidden, vocab, seed, tile_rows)

    grad_exists = state == "grad_exists"
    zero = torch.zeros_like(head.weight) if grad_exists else None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = _status("VmRSS")
    cpu, wall = [], []
    keeping = fused_into_grad.keeping_buffers() if state != "first_fresh" else contextlib.nullcontext()
    with keeping:  # as GradAccTrainer's training loop runs the fused head
        for i in range(repeats + 1):
            head.weight.grad = zero.zero_() if zero is not None else None
            h = h0.clone().requires_grad_(True)
            start_cpu, start_wall = time.process_time(), time.perf_counter()
            loss = loss_of(method, h)
            loss.backward()
            if i:
                cpu.append(time.process_time() - start_cpu)
                wall.append(time.perf_counter() - start_wall)
    peak = _status("VmHWM") - baseline
    loss, grad_hidden, grad_weight = float(loss), h.grad, head.weight.grad.clone()
    del h
    head.weight.grad = None
    w64 = head.weight.detach().double().requires_grad_(True)
    h64 = h0.double().requires_grad_(True)
    ref = F.cross_entropy(h64 @ w64.T, targets, ignore_index=-100, reduction="sum")
    ref.backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b).norm() / b.norm())

    return {
        "method": method, "rows": rows, "hidden": hidden, "vocab": vocab, "grad_exists": grad_exists, "state": state,
        "cpu_s": cpu, "wall_s": wall, "peak_bytes": peak,
        "tile_rows": min(rows, tile_rows or rows_per_tile(rows, hidden, vocab)) if method == "hf_gradacc_tiles" else None,
        "into_grad_writes": fused_into_grad.STATS.written, "into_grad_corrected": fused_into_grad.STATS.corrected,
        "kept_buffer_reused": fused_into_grad.STATS.reused,
        "loss_rel_error": abs(loss - float(ref)) / abs(float(ref)),
        "grad_hidden_rel_error": rel(grad_hidden, h64.grad), "grad_weight_rel_error": rel(grad_weight, w64.grad),
    }  # fmt: skip


def run_pair(methods: tuple[str, ...], rows: int, hidden: int, vocab: int, repeats: int, seed: int, state: str,
             tile_rows: int | None = None) -> dict:  # fmt: skip
    """Methods timed in ONE process, alternating (A B, B A, A B, ...) after one warm-up of each: the CPU time of each
    repeat of each, and the ratio of each later method to the first per pair. A machine that slows down or speeds up
    during the run (other tenants, frequency) shifts both halves of a pair alike, where the one-process-per-method
    runs of :func:`run_one` each see a different stretch of it. ``three_matmuls`` (with ``--floor``): the products
    every method needs (logits, the hidden states' gradient, the weight's) into buffers made once, nothing else."""
    import torch

    from hf_gradacc.fused import into_grad as fused_into_grad

    head, h0, targets, loss_of = _case(rows, hidden, vocab, seed, tile_rows)

    zero = torch.zeros_like(head.weight) if state == "grad_exists" else None
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    if "three_matmuls" in methods:
        weight, logits = head.weight.detach(), torch.empty(rows, vocab)
        grad_hidden, grad_weight = torch.empty(rows, hidden), torch.zeros(vocab, hidden)

    def run(method: str) -> None:
        if method == "three_matmuls":
            torch.mm(h0, weight.t(), out=logits)
            torch.mm(logits, weight, out=grad_hidden)
            torch.mm(logits.t(), h0, out=grad_weight)
            return
        loss_of(method, h0.clone().requires_grad_(True)).backward()

    keeping = fused_into_grad.keeping_buffers() if state != "first_fresh" else contextlib.nullcontext()
    with keeping:
        for i in range(repeats + 1):
            for method in methods if i % 2 == 0 else methods[::-1]:
                head.weight.grad = zero.zero_() if zero is not None else None
                start = time.process_time()
                run(method)
                if i:
                    cpu[method].append(time.process_time() - start)
    first = methods[0]
    by_method = {m: [y / x for x, y in zip(cpu[first], cpu[m])] for m in methods[1:]}
    return {"methods": list(methods), "rows": rows, "hidden": hidden, "vocab": vocab, "state": state,
            "cpu_s": cpu, "ratios": by_method[methods[1]], "ratios_by_method": by_method,
            "kept_buffer_reused": fused_into_grad.STATS.reused}  # fmt: skip


def _shape(text: str) -> tuple[int, int, int]:
    rows, hidden, vocab = (int(x) for x in text.lower().split("x"))
    return rows, hidden, vocab


STATES = {
    "first": "none (first micro-batch, buffer kept)",
    "first_fresh": "none (first micro-batch, run's first window)",
    "grad_exists": "present (micro-batches 2..N)",
}


def _state(r: dict[str, Any]) -> str:
    return r.get("state") or ("grad_exists" if r["grad_exists"] else "first")  # records from before "state"


def markdown(results: list[dict[str, Any]], command: str, load: str = "") -> str:
    """The table: per shape, state of the weight's ``.grad`` and method, CPU time (median [min-max]) and its ratio to
    the full logits' median in the same state, peak memory and its ratio, the errors against float64."""
    import torch

    lines = [
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}, one thread, float32{load}. Command: `{command}`",
        "",
        "| rows x hidden x vocabulary | weight's .grad | method | tile rows | CPU time, median [min-max] | "
        "vs full logits | vs full logits, paired: median [min-max] | wall (median) | peak memory | vs full logits | "
        "loss / grad hidden / grad weight rel. error vs float64 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(results, key=lambda r: (_key(r)[:3], r["grad_exists"], _state(r) == "first_fresh")):
        full = next((x for x in results if x["method"] == "full_logits" and _key(x) == _key(r)), None)
        med = statistics.median(r["cpu_s"])
        cpu_ratio = f"{med / statistics.median(full['cpu_s']):.3f}x" if full else "-"
        mem_ratio = f"{r['peak_bytes'] / max(full['peak_bytes'], 1):.2f}x" if full else "-"
        ratios = (r.get("paired") or {}).get("ratios")
        paired = "-"
        if ratios:  # bold where it meets issue 26's 0.9x
            median = f"{statistics.median(ratios):.3f}x"
            median = f"**{median}**" if statistics.median(ratios) <= 0.9 else median
            paired = f"{median} [{min(ratios):.3f}-{max(ratios):.3f}]"
        lines.append(
            f"| {r['rows']} x {r['hidden']} x {r['vocab']} | {STATES[_state(r)]} | {r['method']} | "
            f"{r['tile_rows'] or '-'} | {med:.3f} s [{min(r['cpu_s']):.3f}-{max(r['cpu_s']):.3f}] | {cpu_ratio} | {paired} | "
            f"{statistics.median(r['wall_s']):.3f} s | {r['peak_bytes'] / 2**20:,.0f} MiB | {mem_ratio} | "
            f"{r['loss_rel_error']:.1e} / {r['grad_hidden_rel_error']:.1e} / {r['grad_weight_rel_error']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def _key(r: dict[str, Any]) -> tuple:
    # both first states compare with the full logits' first
    return r["rows"], r["hidden"], r["vocab"], r["grad_exists"]


PAIR = ("full_logits", "hf_gradacc_tiles")


def _worker(method: str, shape: str, state: str, opts: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """``method`` (or ``pair``) on ``shape`` in ``state``, in a fresh process; its result."""
    command = [sys.executable, os.path.abspath(__file__), "--repeats", str(opts.repeats), "--seed", str(opts.seed),
               "--worker", f"{method}:{shape}", "--state", state]  # fmt: skip
    command += ["--tile_rows", str(opts.tile_rows)] if opts.tile_rows else []
    command += ["--floor"] if opts.floor else []
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=7200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{method} {shape} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="rows x hidden x vocabulary, comma-separated")
    parser.add_argument("--methods", default="full_logits,hf_gradacc_tiles", help=f"any of {','.join(METHODS)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--states", default="first,first_fresh,grad_exists",
                        help="the weight's .grad before each repeat: first (None: a first micro-batch, the fused "
                        "head's buffer kept from the last repeat), first_fresh (None, no buffer kept: a run's first "
                        "window), grad_exists (a zeroed one: micro-batches 2..N of accumulation); comma-separated")  # fmt: skip
    parser.add_argument("--grad_exists", action="store_true", help="the same as --states grad_exists")
    parser.add_argument("--state", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no_pairs", action="store_true",
                        help="skip the paired run (full logits and the fused head alternating in one process) that "
                        "gives the ratio column a busy machine does not move")  # fmt: skip
    parser.add_argument("--floor", action="store_true",
                        help="the paired run also times the three matmuls alone (the floor of every method)")  # fmt: skip
    parser.add_argument(
        "--tile_rows", type=int, default=None, help="the fused head's rows per tile (default: its own)"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        method, shape = opts.worker.split(":")
        state = "grad_exists" if opts.grad_exists else opts.state or "first"
        if method == "pair":
            methods = PAIR + (("three_matmuls",) if opts.floor else ())
            result = run_pair(methods, *_shape(shape), opts.repeats, opts.seed, state, opts.tile_rows)
        else:
            result = run_one(method, *_shape(shape), opts.repeats, opts.seed, state, opts.tile_rows)
        print("RESULT " + json.dumps(result))
        return []
    states = ["grad_exists"] if opts.grad_exists else opts.states.split(",")
    if set(states) - set(STATES):
        raise SystemExit(f"--states: {opts.states!r}: use any of {', '.join(STATES)}")
    env = {**os.environ, **ONE_THREAD}
    results, loads = [], [os.getloadavg()[0]]
    for shape in opts.shapes.split(","):
        for state in states:
            for method in opts.methods.split(","):
                if method not in METHODS:
                    raise SystemExit(f"--methods: {method!r} is not one of {METHODS}")
                if state == "first_fresh" and method != "hf_gradacc_tiles":
                    continue  # only the fused head keeps a buffer: the others' first is this state too
                results.append(_worker(method, shape, state, opts, env))
                loads.append(os.getloadavg()[0])
                r = results[-1]
                print(f"{method} {shape} .grad {state}: CPU median {statistics.median(r['cpu_s']):.3f} s, "
                      f"peak {r['peak_bytes'] / 2**20:,.0f} MiB, in-place writes {r['into_grad_writes']}, "
                      f"kept buffer reused {r['kept_buffer_reused']}",
                      flush=True)  # fmt: skip
            fused = next((r for r in results if r["method"] == PAIR[1] and _key(r)[:3] == _shape(shape)
                          and _state(r) == state), None)  # fmt: skip
            if fused is not None and not opts.no_pairs and PAIR[0] in opts.methods.split(","):
                fused["paired"] = _worker("pair", shape, state, opts, env)
                loads.append(os.getloadavg()[0])
                for name, ratios in fused["paired"]["ratios_by_method"].items():
                    print(f"paired {shape} .grad {state}: {name} / full {statistics.median(ratios):.3f} "
                          f"[{min(ratios):.3f}-{max(ratios):.3f}]", flush=True)  # fmt: skip
    load = f", load average (1 min) {min(loads):.1f}-{max(loads):.1f}"
    table = markdown(
        results, "python benchmarks/fused_head.py " + " ".join(sys.argv[1:] if argv is None else argv), load
    )
    print("\n" + table)
    if opts.markdown:
        with open(opts.markdown, "w") as f:
            f.write(table)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
