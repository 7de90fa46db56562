"""headwise (all heads full) vs HF transformers on the default model: prefill time at
1K/4K/8K and decode tokens/s at 1K/4K context, batch 1, same dtype and thread count,
median of --runs runs.   python benchmarks/bench_engine.py [--runs 3] [--out bench/engine.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Stat, hf_single, headwise_single, load_hf_default, machine, prompt_ids, save  # noqa: E402
from headwise.config import DTYPE_CHOICES, dtype_name  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefill", default="1024,4096,8192")
    ap.add_argument("--decode", default="1024,4096")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES))
    ap.add_argument("--out", default="bench/engine.json")
    a = ap.parse_args()
    from headwise import LLM

    llm = LLM(head_layout="full", dtype=a.dtype, kv_cache_memory=1 << 30, max_num_batched_tokens=8192)
    a.dtype = dtype_name(llm.engine.dtype)  # what "auto" resolved to
    hf = load_hf_default(llm.engine.dtype)
    tok = llm.tokenizer
    lengths = sorted({int(x) for x in a.prefill.split(",")} | {int(x) for x in a.decode.split(",")})
    rows, records = [], []
    for L in lengths:
        ids = prompt_ids(tok, min(L, llm.engine.max_model_len - a.new_tokens - 1), salt=L)
        res = {}
        for name, fn in (("headwise", lambda: headwise_single(llm, ids, a.new_tokens)),
                         ("transformers", lambda: hf_single(hf, ids, a.new_tokens))):
            if L == lengths[0]:
                fn()  # warm-up
            runs = [fn() for _ in range(a.runs)]
            res[name] = (Stat.of([r[0] for r in runs]), Stat.of([r[1] for r in runs]))
            print(f"{L:>6} {name:<13} prefill {res[name][0].fmt()} s  decode {res[name][1].fmt('.1f')} tok/s",
                  flush=True)
        rows.append((L, res))
        for name, (p, d) in res.items():
            records.append({"system": name, "context": L, "prefill_s": vars(p), "decode_tok_s": vars(d)})
    lines = [f"Machine: {machine()}; dtype {a.dtype}; median [min-max] of {a.runs} runs", "",
             "| context | headwise prefill s | transformers prefill s | speed-up | headwise decode tok/s | transformers decode tok/s | speed-up |",
             "|---|---|---|---|---|---|---|"]
    prefill_set, decode_set = {int(x) for x in a.prefill.split(",")}, {int(x) for x in a.decode.split(",")}
    for L, res in rows:
        (hp, hd), (tp, td) = res["headwise"], res["transformers"]
        pf = (f"{hp.fmt()} | {tp.fmt()} | {tp.median / hp.median:.2f}x" if L in prefill_set else "- | - | -")
        dc = (f"{hd.fmt('.1f')} | {td.fmt('.1f')} | {hd.median / td.median:.2f}x" if L in decode_set else "- | - | -")
        lines.append(f"| {L} | {pf} | {dc} |")
    table = "\n".join(lines)
    print("\n" + table)
    save(a.out, {"machine": machine(), "records": records}, table)


if __name__ == "__main__":
    main()
