"""The int8 copies (headwise/kernels/int8_matmul.py) of a model's exactly-int8 linears
against their prepacked bfloat16 weights, at decode-sized row counts: per model, one
pass over every such linear (SmolLM2: the tied vocabulary projection, GGUF Q8_0; Gemma 3
270M: the vocabulary projection, Q8_0, and its Q5_0/Q8_0 q/k/v/gate/up projections).

    python benchmarks/bench_int8.py [--models SmolLM2-135M-Instruct,gemma-3-270m] [--rows 1,2,4,8] [--runs 7]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_linear import time_pass  # noqa: E402
from benchmarks.common import machine, save  # noqa: E402


def int8_linears(model_name: str):
    """The model's linears that keep an int8 copy, prepared for bfloat16 as the engine does."""
    from headwise.layers.linear import Linear
    from headwise.weights.loader import load_model

    model, _ = load_model(model_name, torch.float32)
    model.prepare_weights(torch.bfloat16)
    return [m for m in model.modules() if isinstance(m, Linear) and m.int8_codes is not None]


def main(argv: list[str] | None = None) -> int:
    from headwise.kernels.int8_matmul import MAX_ROWS, int8_matmul

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="SmolLM2-135M-Instruct,gemma-3-270m")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default="bench/int8_linear.json")
    args = ap.parse_args(argv)
    lines = [f"Machine: {machine()}; bfloat16 activations; ms per pass over the model's int8 linears, "
             f"median [min-max] of {args.runs}; the engine uses the int8 copy up to {MAX_ROWS} rows", "",
             "| model | linears | weight MiB bf16 / int8 | rows | prepacked bf16 | int8 copy | speed-up |",
             "|---|---|---|---|---|---|---|"]
    records = []
    for name in args.models.split(","):
        lins = int8_linears(name)
        mib16 = sum(m.in_features * m.out_features * 2 for m in lins) / 2**20
        mib8 = sum(m.int8_codes.numel() + m.int8_scales.numel() * 4 for m in lins) / 2**20
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {m.in_features for m in lins}}

            def packed():
                for m in lins:
                    torch.ops.mkldnn._linear_pointwise(xs[m.in_features], m.packed, m.bias, "none", [], "")

            def int8():
                for m in lins:
                    int8_matmul(xs[m.in_features], m.int8_codes, m.int8_scales)

            a = time_pass(packed, args.runs)
            b = time_pass(int8, args.runs) if rows <= MAX_ROWS else None
            records.append({"model": name, "linears": len(lins), "rows": rows, "packed_ms": a.median,
                            "int8_ms": None if b is None else b.median})
            lines.append(f"| {name} | {len(lins)} | {mib16:.0f} / {mib8:.0f} | {rows} | {a.fmt()} | "
                         f"{'-' if b is None else b.fmt()} | {'-' if b is None else f'{a.median / b.median:.2f}x'} |")
            print(lines[-1], flush=True)
        del lins
    table = "\n".join(lines)
    print("\n" + table)
    save(args.out, {"machine": machine(), "records": records}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
