"""What one packed row costs against a padded batch of the same samples, on the benchmark's model.

    python benchmarks/packed_row_cost.py                    # the numbers quoted in docs/benchmarks.md
    python benchmarks/packed_row_cost.py --vocab-size 32000 --repeats 10

A packed row of T tokens is one sequence to the attention kernel: eager and sdpa compute all T x T scores and mask
the cross-sample ones, so a row's attention grows with T squared while a padded batch's grows with rows x longest
squared. This script times forward + backward of the same ten samples (about 1024 tokens, lengths 44 to 200) as one
packed row, as two packed rows, and as one padded batch, for each attention implementation, and prints milliseconds
per pass (median of the repeats after two warm-up passes).

``--fit`` calibrates the attention-cost model of packing instead (:class:`hf_gradacc.data.attention_cost.AttentionCostModel`):
it times padded batches ``[n, L]`` and packed rows ``[1, T]`` of several shapes, fits ``time = per_micro_batch +
per_token * positions + per_score * attention scores`` by least squares (scores: ``n * L^2`` padded, ``T^2`` packed
on a dense kernel), and prints the fitted ratios next to the ones the model derives from the config:

    python benchmarks/packed_row_cost.py --fit                # vocabulary 96
    python benchmarks/packed_row_cost.py --fit --vocab-size 32000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

from hf_gradacc.commands.bench.benchmark import BenchSettings, build_bench_model  # noqa: E402

LENGTHS = (100, 80, 150, 60, 120, 90, 200, 70, 110, 44)  # 1024 tokens, a long-tailed-looking mix


def packed_batch(lengths, vocab_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab_size, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "position_ids": positions, "labels": ids.clone()}


def padded_batch(lengths, vocab_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab_size, (len(lengths), max(lengths)))
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def time_passes(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], repeats: int) -> float:
    """Median milliseconds of forward + backward over all ``batches``."""
    for _ in range(2):
        for batch in batches:
            model(**batch).loss.backward()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in batches:
            model(**batch).loss.backward()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


# (rows, length) of the padded batches and lengths of the packed rows that --fit times.
FIT_PADDED = ((8, 100), (16, 50), (4, 200), (2, 400), (8, 256), (1, 1024), (32, 32), (4, 512))
FIT_PACKED = (128, 256, 512, 1024, 2048)


def fit(model: torch.nn.Module, vocab_size: int, repeats: int) -> None:
    """Time the FIT_* layouts with sdpa, fit the three coefficients, print them against the config's model."""
    from hf_gradacc.data.attention_cost import AttentionCostModel

    shapes = []  # (micro-batches, positions, scores, ms)
    for rows, length in FIT_PADDED:
        ms = time_passes(model, [padded_batch([length] * rows, vocab_size)], repeats)
        shapes.append((1, rows * length, rows * length**2, ms, f"padded [{rows}, {length}]"))
    for total in FIT_PACKED:
        lengths = [total // 4] * 4
        ms = time_passes(model, [packed_batch(lengths, vocab_size)], repeats)
        shapes.append((1, total, total**2, ms, f"packed [1, {total}]"))
    design = torch.tensor([s[:3] for s in shapes], dtype=torch.float64)
    measured = torch.tensor([s[3] for s in shapes], dtype=torch.float64)
    scale = design.abs().max(0).values
    coef = torch.linalg.lstsq(design / scale, measured[:, None]).solution[:, 0] / scale
    per_call, per_token, per_score = (float(c) for c in coef)
    derived = AttentionCostModel.for_model(model)
    print(
        f"fit: {per_call:.3f} ms per micro-batch + {per_token * 1e3:.3f} us per position + {per_score * 1e6:.3f} ns per score"
    )
    print(f"fitted  (token units): per micro-batch {per_call / per_token:8.1f}, per score {per_score / per_token:.2e}")
    print(f"derived (token units): per micro-batch {derived.per_micro_batch:8.1f}, per score {derived.per_score:.2e}")
    print(f"{'layout':<20} {'measured ms':>12} {'fit ms':>8} {'derived (token units)':>22}")
    for (calls, positions, scores, ms, name), predicted in zip(shapes, (design @ coef).tolist()):
        modelled = calls * derived.per_micro_batch + positions + scores * derived.per_score
        print(f"{name:<20} {ms:>12.1f} {predicted:>8.1f} {modelled:>22.0f}")


def main(argv: list[str] | None = None) -> None:
    d = BenchSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=d.hidden_size)
    parser.add_argument("--num-layers", type=int, default=d.num_layers)
    parser.add_argument("--num-heads", type=int, default=d.num_heads)
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fit", action="store_true", help="calibrate the attention-cost model of packing")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    settings = BenchSettings(
        hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads, vocab_size=args.vocab_size
    )
    model = build_bench_model(settings)
    if args.fit:
        model.set_attn_implementation("sdpa")
        fit(model, args.vocab_size, args.repeats)
        return
    half = len(LENGTHS) // 2
    layouts = {
        f"one packed row [1, {sum(LENGTHS)}]": [packed_batch(LENGTHS, args.vocab_size)],
        "two packed rows [1, ~512]": [packed_batch(LENGTHS[:half], args.vocab_size),
                                      packed_batch(LENGTHS[half:], args.vocab_size)],
        f"padded [{len(LENGTHS)}, {max(LENGTHS)}]": [padded_batch(LENGTHS, args.vocab_size)],
    }  # fmt: skip
    print(
        f"model: hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads} heads, vocab {args.vocab_size}"
    )
    print(f"{'attention':<10} " + " ".join(f"{name:>28}" for name in layouts))
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        row = [time_passes(model, batches, args.repeats) for batches in layouts.values()]
        print(f"{implementation:<10} " + " ".join(f"{ms:>25.1f} ms" for ms in row))


if __name__ == "__main__":
    main()
