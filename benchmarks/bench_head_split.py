"""`full` layout vs a head-split layout on the default model at 2K/4K/8K, in one run,
each also with an int8 KV cache (--kv-dtypes; "" for none): KV bytes per sequence, time
to first token, decode tokens/s at batch 1, sequences that fit a fixed KV budget, and
aggregate decode tokens/s with that many sequences; KV bytes at 32K, computed.

    python benchmarks/bench_head_split.py [--layout PATH] [--budget-gib 2] [--runs 3] [--kv-dtypes int8]

Without --layout the model's shipped calibrated layout is used (or, if none, the first
25% of heads in layer order are full).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Stat, headwise_aggregate, headwise_single, machine, prompt_ids, save  # noqa: E402


def split_layout(arg: str | None):
    from headwise.heads.layout import HeadLayout
    from headwise.layouts import shipped_layout
    from headwise.weights.loader import DEFAULT_MODEL_NAME

    if arg:
        return arg if arg in ("full", "window") else HeadLayout.load(arg)
    shape = (30, 3, 64)
    layout = shipped_layout(DEFAULT_MODEL_NAME, shape)
    if layout is None:
        pairs = [(l, h) for l in range(30) for h in range(3)]
        layout = HeadLayout.from_full_set("first-25%", shape, set(pairs[: len(pairs) // 4]),
                                          model=DEFAULT_MODEL_NAME)
    return layout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default=None)
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--agg-steps", type=int, default=8)
    ap.add_argument("--kv-dtypes", default="int8", help="extra KV cache dtypes, comma-separated")
    ap.add_argument("--out", default="bench/head_split.json")
    a = ap.parse_args()
    from headwise import LLM
    from headwise.config import dtype_name

    budget = int(a.budget_gib * 2**30)
    contexts = [int(x) for x in a.contexts.split(",")]
    kv_dtypes = [d for d in a.kv_dtypes.split(",") if d]
    layouts = {}  # name -> (layout, kv_cache_dtype)
    for kv in ["auto", *kv_dtypes]:
        suffix = "" if kv == "auto" else f"+{kv}"
        layouts[f"full{suffix}"] = ("full", kv)
        layouts[f"split{suffix}"] = (split_layout(a.layout), kv)
    records, res, dtype, at_32k = [], {}, None, {}
    for name, (layout, kv) in layouts.items():
        llm = LLM(head_layout=layout, kv_cache_memory=1 << 30, max_num_batched_tokens=8192, kv_cache_dtype=kv)
        at_32k[name] = llm.kv_bytes(32768)
        label = f"{name} ({llm.layout.full_fraction:.1%} full heads{'' if kv == 'auto' else ', KV ' + kv})"
        dtype = dtype_name(llm.engine.dtype)
        headwise_single(llm, prompt_ids(llm.tokenizer, 512), 4)  # warm-up
        for L in contexts:
            ids = prompt_ids(llm.tokenizer, min(L, llm.engine.max_model_len - a.new_tokens - 1), salt=L)
            runs = [headwise_single(llm, ids, a.new_tokens) for _ in range(a.runs)]
            per_seq = llm.kv_bytes(L + a.agg_steps + 2)
            conc = budget // per_seq
            big = LLM(head_layout=layout, kv_cache_memory=budget, max_num_seqs=max(1, conc),
                      max_num_batched_tokens=8192, kv_cache_dtype=kv)
            assert big.engine.cache.max_concurrency(L + a.agg_steps + 2) >= conc
            ctx_len = min(L, llm.engine.max_model_len - a.agg_steps - 2)  # room to decode
            agg = [headwise_aggregate(big, ctx_len, conc, a.agg_steps) for _ in range(a.runs)]
            del big
            r = {"layout": label, "context": L, "kv_bytes_per_seq": llm.kv_bytes(L),
                 "ttft_s": Stat.of([x[0] for x in runs]), "decode_tok_s": Stat.of([x[1] for x in runs]),
                 "max_concurrency": conc, "agg_tok_s": Stat.of(agg)}
            res[(name, L)] = r
            print(f"{label:<28} {L:>5}: KV {r['kv_bytes_per_seq'] / 2**20:7.1f} MiB  TTFT {r['ttft_s'].fmt()} s  "
                  f"decode {r['decode_tok_s'].fmt('.1f')} tok/s  fit {conc}  agg {r['agg_tok_s'].fmt('.1f')} tok/s",
                  flush=True)
            records.append({k: (vars(v) if isinstance(v, Stat) else v) for k, v in r.items()})
        del llm
    lines = [f"Machine: {machine()}; {dtype}; KV budget {a.budget_gib:g} GiB; median [min-max] of {a.runs} runs; "
             f"aggregate decode over {a.agg_steps} steps with the cache pre-filled to the context", "",
             "| context | layout | KV MiB/seq | TTFT s | decode tok/s (batch 1) | seqs in budget | aggregate decode tok/s |",
             "|---|---|---|---|---|---|---|"]
    for L in contexts:
        for name in layouts:
            r = res[(name, L)]
            lines.append(f"| {L} | {r['layout']} | {r['kv_bytes_per_seq'] / 2**20:.1f} | {r['ttft_s'].fmt()} | "
                         f"{r['decode_tok_s'].fmt('.1f')} | {r['max_concurrency']} | {r['agg_tok_s'].fmt('.1f')} |")
        pairs = [("split", "full")] + [(f"split+{kv}", base) for kv in kv_dtypes
                                       for base in ("full", f"full+{kv}", "split")]
        for num, den in pairs:
            s, f = res[(num, L)], res[(den, L)]
            lines.append(f"| {L} | **{num} / {den}** | **{f['kv_bytes_per_seq'] / s['kv_bytes_per_seq']:.2f}x smaller** | "
                         f"**{f['ttft_s'].median / s['ttft_s'].median:.2f}x faster** | "
                         f"**{s['decode_tok_s'].median / f['decode_tok_s'].median:.2f}x** | "
                         f"**{s['max_concurrency'] / f['max_concurrency']:.2f}x** | "
                         f"**{s['agg_tok_s'].median / f['agg_tok_s'].median:.2f}x** |")
    lines += ["", "KV bytes per 32K-token sequence, computed (the model itself stops at 8K):", "",
              "| layout | KV MiB/seq at 32K | full / this |", "|---|---|---|"]
    lines += [f"| {n} | {b / 2**20:.1f} | {at_32k['full'] / b:.2f}x |" for n, b in at_32k.items()]
    table = "\n".join(lines)
    print("\n" + table)
    save(a.out, {"machine": machine(), "dtype": dtype, "records": records}, table)


if __name__ == "__main__":
    main()
