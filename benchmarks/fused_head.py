"""The LM head's loss three ways, forward + backward, on CPU: full logits, torch 2.13's chunked
``F.linear_cross_entropy`` and hf_gradacc's tiles (:mod:`hf_gradacc.fused_head`); time, peak memory, exactness.

    python benchmarks/fused_head.py                                   # 151,936 vocabulary, the shapes below
    python benchmarks/fused_head.py --shapes 2048x64,512x512 --repeats 3 --json fused_head.json

Per shape ``rows x hidden`` (rows: the positions whose target counts), each method runs in its own process
(``--threads``: torch threads, default every core, as training runs): the loss SUM and its gradients with respect
to the hidden states and the head's weight, ``repeats`` times after one warm-up. Peak memory: the rise of the
resident-set high-water mark over the resident set once the inputs exist (glibc's default allocator, as in training;
``HF_GRADACC_BENCH_SMALL_MMAP=1`` maps every block over 32 KiB instead, the setting of the 2026-11-24 record, which
makes each tile's allocations page-fault). Exactness: the largest relative error of the loss and both
gradients against a float64 computation of the full logits.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

METHODS = ("full_logits", "torch_linear_cross_entropy", "hf_gradacc_tiles")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise OSError(key)


def run_one(
    method: str, rows: int, hidden: int, vocab: int, repeats: int, seed: int, threads: int = 0
) -> dict[str, Any]:
    if os.environ.get("HF_GRADACC_BENCH_SMALL_MMAP") == "1":  # the 2026-11-24 setting: every block over 32 KiB mmapped
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 * 1024)
        libc.mallopt(-1, 128 * 1024)
    import torch
    import torch.nn.functional as F

    from hf_gradacc.fused_head import fused_cross_entropy_sum

    if threads:
        torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * hidden**-0.5)
    h0 = torch.randn(rows, hidden, generator=g)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[::7] = -100  # a few ignored rows pass through too

    def loss_of(h: torch.Tensor) -> torch.Tensor:
        if method == "full_logits":
            return F.cross_entropy(head(h).float(), targets, ignore_index=-100, reduction="sum")
        if method == "torch_linear_cross_entropy":
            return F.linear_cross_entropy(h, head.weight, targets, reduction="sum", ignore_index=-100,
                                          options=torch.nn.LinearCrossEntropyOptions())  # fmt: skip
        return fused_cross_entropy_sum(h, head.forward, targets)  # as the trainer calls it

    # float64 reference, full logits (before the probe: it is not part of the method's memory)
    w64 = head.weight.detach().double().requires_grad_(True)
    h64 = h0.double().requires_grad_(True)
    ref = F.cross_entropy(h64 @ w64.T, targets, ignore_index=-100, reduction="sum")
    ref.backward()
    ref_loss, ref_gh, ref_gw = float(ref), h64.grad.float(), w64.grad.float()
    del w64, h64, ref

    times, losses = [], []
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = _status("VmRSS")
    for i in range(repeats + 1):
        head.weight.grad = None
        h = h0.clone().requires_grad_(True)
        start = time.perf_counter()
        loss = loss_of(h)
        loss.backward()
        elapsed = time.perf_counter() - start
        if i:
            times.append(elapsed)
        losses.append(float(loss))
    peak = _status("VmHWM") - baseline

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).norm() / b.double().norm())

    return {
        "method": method, "rows": rows, "hidden": hidden, "vocab": vocab,
        "median_s": statistics.median(times), "peak_bytes": peak,
        "loss_rel_error": abs(losses[-1] - ref_loss) / abs(ref_loss),
        "grad_hidden_rel_error": rel(h.grad, ref_gh), "grad_weight_rel_error": rel(head.weight.grad, ref_gw),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab_size", type=int, default=151936)
    parser.add_argument("--shapes", default="2048x64,512x512", help="rows x hidden, comma-separated")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default, every core)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        method, shape = opts.worker.split(":")
        rows, hidden = (int(x) for x in shape.split("x"))
        result = run_one(method, rows, hidden, opts.vocab_size, opts.repeats, opts.seed, opts.threads)
        print("RESULT " + json.dumps(result))
        return []
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if opts.threads:
        env.update(OMP_NUM_THREADS=str(opts.threads), MKL_NUM_THREADS=str(opts.threads))
    results = []
    for shape in opts.shapes.split(","):
        for method in opts.methods.split(","):
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--vocab_size", str(opts.vocab_size), "--repeats",
                 str(opts.repeats), "--seed", str(opts.seed), "--threads", str(opts.threads),
                 "--worker", f"{method}:{shape}"],
                env=env, capture_output=True, text=True, timeout=3600,
            )  # fmt: skip
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{method} {shape} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT ") :]))
            print(f"{method} {shape}: done", flush=True)
    import torch

    threads = opts.threads or torch.get_num_threads()
    print(f"\nvocabulary {opts.vocab_size}, torch threads {threads}, python {platform.python_version()}")
    print("| rows x hidden | method | forward + backward (median) | vs full logits | peak memory | vs full logits | "
          "loss / grad hidden / grad weight rel. error vs float64 |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        full = next(x for x in results if (x["rows"], x["hidden"]) == (r["rows"], r["hidden"])
                    and x["method"] == "full_logits")  # fmt: skip
        print(f"| {r['rows']} x {r['hidden']} | {r['method']} | {r['median_s'] * 1e3:,.0f} ms | "
              f"{r['median_s'] / full['median_s']:.2f}x | {r['peak_bytes'] / 2**20:,.0f} MiB | "
              f"{r['peak_bytes'] / max(full['peak_bytes'], 1):.2f}x | {r['loss_rel_error']:.1e} / "
              f"{r['grad_hidden_rel_error']:.1e} / {r['grad_weight_rel_error']:.1e} |")  # fmt: skip
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
