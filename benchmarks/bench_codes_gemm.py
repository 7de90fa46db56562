"""A model's quantized linears, at decode and prefill row counts, each way the engine can
multiply them, and the bytes each form holds; ms per pass, median [min-max].

4-bit weights (q/k/v and gate/up fused, as decode runs them; their parts' packed weights
for the first column): the prepacked bfloat16 weight the engine runs from 9 rows on
(oneDNN), PyTorch's int4 CPU matmul it runs up to 8 rows, and int4_gemm over the codes
(kernels/codes_gemm.py), which a model kept without dense copies runs from 9 rows on; on
a CPU with AMX, int4_gemm twice: with AVX512-BF16 dot products ("vector") and with AMX
tiles (what the engine runs there).

int8 weights (Q6_K, Q8_0, Q5_0 ..., the vocabulary projection among them): the
prepacked bfloat16 weight, kernels.int8_matmul (up to 4 rows, either way), and
int8_gemm over the codes (above 4 rows without dense copies).

    python benchmarks/bench_codes_gemm.py [--model qwen2.5-coder-1.5b] [--rows 1,4,8,16,32,64,256,1024] [--runs 5]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_linear import time_pass  # noqa: E402
from benchmarks.common import machine, save  # noqa: E402

TORCH_INT4_MAX_ROWS = 64  # PyTorch's int4 kernel is 2-2.5x the packed weight's time from 32 rows: not timed past this
INT8_MATMUL_MAX_ROWS = 4  # kernels.int8_matmul.MAX_ROWS


def quantized(model_name: str):
    """(packed Linears whose weight is 4-bit, the 4-bit copies covering the same weights,
    packed Linears with an int8 copy) of the model prepared for bfloat16 as the engine
    does with dense copies."""
    from headwise.layers.int4 import Int4Copy
    from headwise.layers.linear import Linear
    from headwise.weights.loader import load_weights

    model = load_weights(model_name, torch.bfloat16, lazy=True)
    model.prepare_weights(torch.bfloat16)
    packed = [m for m in model.modules() if isinstance(m, Linear) and m.packed is not None
              and (m.fused_int4 or m.int4 is not None)]
    copies = [m for m in model.modules() if isinstance(m, Int4Copy) and m.int4 is not None]
    int8 = [m for m in model.modules() if isinstance(m, Linear) and m.packed is not None and m.int8_codes is not None]
    return packed, copies, int8


def timed_row(rows: int, runs: int, fns: list) -> tuple[str, list[float | None]]:
    """A table row timing each of `fns` (None: not timed), the last against the first, and
    their medians."""
    stats = [None if fn is None else time_pass(fn, runs) for fn in fns]
    line = (f"| {rows} | " + " | ".join("-" if st is None else st.fmt() for st in stats)
            + f" | {stats[-1].median / stats[0].median:.2f}x |")
    print(line, flush=True)
    return line, [None if st is None else st.median for st in stats]


def mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None) / 2**20


@torch.inference_mode()  # as the engine runs: in grad mode oneDNN took 50 ms for one row with a bias needing grad
def main(argv: list[str] | None = None) -> int:
    from headwise.kernels.codes_gemm import gemm_amx, int4_gemm, int8_gemm
    from headwise.kernels.int8_matmul import int8_matmul
    from headwise.layers.int4 import int4_matmul

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rows", default="1,4,8,16,32,64,256,1024")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="bench/codes_gemm.json")
    args = ap.parse_args(argv)
    packed, copies, int8 = quantized(args.model)
    probe = copies[0] if copies else None
    if probe is None or int4_gemm(torch.zeros(1, probe.in_features, dtype=torch.bfloat16), *probe.int4) is None:
        print("the matmuls over codes do not run here (no 4-bit weights, no AVX512-BF16 build, or another layout)")
        return 1
    rows_list = [int(r) for r in args.rows.split(",")]
    amx = gemm_amx()
    vector_col = " | vector" if amx else ""
    weights4 = sum(m.in_features * m.out_features for m in packed)
    weights8 = sum(m.in_features * m.out_features for m in int8)
    mib4 = mib(t for m in copies for t in m.int4)
    mib8 = mib(t for m in int8 for t in (m.int8_codes, m.int8_scales, m.int8_lows))
    lines = [f"Machine: {machine()}; {args.model}, bfloat16; ms per pass, median [min-max] of {args.runs}", "",
             f"{len(packed)} 4-bit linears ({weights4 / 1e6:.0f}M weights) as {len(copies)} matmuls; prepacked bf16 "
             f"{weights4 * 2 / 2**20:.0f} MiB, 4-bit codes with scales {mib4:.0f} MiB", "",
             f"| rows | prepacked bf16 | PyTorch int4{vector_col} | int4_gemm | int4_gemm / prepacked |",
             "|---|---|---|---|---|" + "---|" * amx]
    records = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {m.in_features for m in packed + int8}}

        def run_packed(mods=packed):
            for m in mods:
                torch.ops.mkldnn._linear_pointwise(xs[m.in_features], m.packed, m.bias, "none", [], "")

        def run_torch_int4():
            for m in copies:
                int4_matmul(xs[m.in_features], m.int4)

        def run_gemm(amx_on=amx):
            gemm_amx(amx_on)
            for m in copies:
                int4_gemm(xs[m.in_features], *m.int4)

        line, times = timed_row(rows, args.runs, [run_packed, run_torch_int4 if rows <= TORCH_INT4_MAX_ROWS else None,
                                                  *([lambda: run_gemm(False)] if amx else []), run_gemm])
        lines.append(line)
        records.append({"weights": "4-bit", "rows": rows, "packed_ms": times[0], "torch_int4_ms": times[1],
                        "int4_gemm_ms": times[-1], **({"int4_gemm_vector_ms": times[2]} if amx else {})})
    if int8:
        lines += ["", f"{len(int8)} int8 linears ({weights8 / 1e6:.0f}M weights); prepacked bf16 "
                  f"{weights8 * 2 / 2**20:.0f} MiB, int8 codes with scales {mib8:.0f} MiB", "",
                  f"| rows | prepacked bf16 | int8_matmul{vector_col} | int8_gemm | int8_gemm / prepacked |",
                  "|---|---|---|---|---|" + "---|" * amx]
        for rows in rows_list:
            xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {m.in_features for m in int8}}

            def run_int8_matmul():
                for m in int8:
                    int8_matmul(xs[m.in_features], m.int8_codes, m.int8_scales, m.int8_lows)

            def run_int8_gemm(amx_on=amx):
                gemm_amx(amx_on)
                for m in int8:
                    int8_gemm(xs[m.in_features], m.int8_codes, m.int8_scales, m.int8_lows)

            line, times = timed_row(rows, args.runs, [lambda: run_packed(int8), run_int8_matmul
                                                      if rows <= INT8_MATMUL_MAX_ROWS else None,
                                                      *([lambda: run_int8_gemm(False)] if amx else []), run_int8_gemm])
            lines.append(line)
            records.append({"weights": "int8", "rows": rows, "packed_ms": times[0], "int8_matmul_ms": times[1],
                            "int8_gemm_ms": times[-1], **({"int8_gemm_vector_ms": times[2]} if amx else {})})
    table = "\n".join(lines)
    print("\n" + table)
    save(args.out, {"machine": machine(), "model": args.model, "amx": amx, "mib_packed_4bit": weights4 * 2 / 2**20,
                    "mib_codes_4bit": mib4, "mib_packed_int8": weights8 * 2 / 2**20, "mib_codes_int8": mib8,
                    "records": records}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
