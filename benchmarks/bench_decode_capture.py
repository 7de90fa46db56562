"""Decode with and without the captured step (engine.decode_capture), beside llama.cpp.

Per context length: batch-1 greedy decode tokens/s of headwise (shipped layout, bfloat16
with the GGUF's 4-bit weights) eager (`enforce_eager=True`) and captured (the default),
and of llama.cpp (llama-cpp-python on the same GGUF, greedy) when installed; the longest
context is cut to leave room for the new tokens within the model's context; also headwise's
aggregate decode at batches of a few sequences (--batches; captured graphs of 2-8 tokens
with a dynamic size, split at 5 on a CPU with AMX) and the capture's compile time at start
(with Inductor's on-disk cache cold or warm, as found; the first run on a machine is cold).

    python benchmarks/bench_decode_capture.py [--model M] [--contexts 1024,2048,4096,8192]
        [--new-tokens 64] [--batches 4] [--runs 3] [--no-llama-cpp] [--out bench/decode_capture.json]
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Stat, headwise_aggregate, headwise_single, machine, prompt_ids, save  # noqa: E402
from headwise import LLM  # noqa: E402

def measure_headwise(model: str | None, enforce_eager: bool, contexts: list[int], new: int, runs: int,
                     batches: list[int]) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model, enforce_eager=enforce_eager, max_num_batched_tokens=8192)
    start_s = time.perf_counter() - t0
    cap = llm.engine.runner.forward
    rec = {"start_s": start_s, "compile_s": cap.compile_s, "captured": cap.enabled, "contexts": {}}
    for L in contexts:
        n = min(L, llm.engine.max_model_len - new - 2)
        ids = prompt_ids(llm.tokenizer, n, L)
        single = Stat.of([headwise_single(llm, ids, new)[1] for _ in range(runs)])  # greedy
        rec["contexts"][L] = {"decode_tok_s": single.__dict__}
        for b in batches:
            rec["contexts"][L][f"batch{b}_tok_s"] = Stat.of([headwise_aggregate(llm, n, b, new)
                                                             for _ in range(runs)]).__dict__
        print(f"headwise {'eager' if enforce_eager else 'captured':<8} {L:>5}: decode {single.fmt('.1f')} tok/s, "
              + ", ".join(f"batch {b} {rec['contexts'][L][f'batch{b}_tok_s']['median']:.1f}" for b in batches)
              + " tok/s", flush=True)
    del llm
    gc.collect()
    return rec


def measure_llama_cpp(model: str | None, contexts: list[int], new: int, runs: int) -> dict | None:
    from benchmarks.peers import LlamaCppSystem, Skip

    try:
        system = LlamaCppSystem(model, max(contexts) + new + 2)
    except Skip as e:
        print(f"llama.cpp skipped: {e}")
        return None
    rec = {"contexts": {}}
    for L in contexts:
        single = Stat.of([system.single(L, new)[1] for _ in range(runs)])
        rec["contexts"][L] = {"decode_tok_s": single.__dict__}
        print(f"llama.cpp         {L:>5}: decode {single.fmt('.1f')} tok/s", flush=True)
    system.close()
    return rec


def table(res: dict) -> str:
    eager, cap, lc = res["eager"], res["captured"], res.get("llama.cpp")
    lines = [f"Machine: {res['machine']}", "",
             f"Start-up: eager {eager['start_s']:.1f} s; captured {cap['start_s']:.1f} s, of which "
             f"compiling {cap['compile_s']:.1f} s.", "",
             "| context | eager tok/s | captured tok/s | captured / eager | llama.cpp tok/s | captured / llama.cpp | "
             + " | ".join(f"eager batch {b} | captured batch {b}" for b in res["batches"]) + " |",
             "|---|---|---|---|---|---|" + "---|---|" * len(res["batches"])]
    for L in res["contexts"]:
        e, c = eager["contexts"][L], cap["contexts"][L]
        ed, cd = e["decode_tok_s"]["median"], c["decode_tok_s"]["median"]
        ld = lc["contexts"][L]["decode_tok_s"]["median"] if lc else None
        lcs = f"{ld:.1f} | {cd / ld:.2f}x" if ld else "- | -"
        lines.append(f"| {L} | {ed:.1f} | {cd:.1f} | {cd / ed:.2f}x | {lcs} | "
                     + " | ".join(f"{e[f'batch{b}_tok_s']['median']:.1f} | {c[f'batch{b}_tok_s']['median']:.1f}"
                                  for b in res["batches"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a known name or path (default: the default model)")
    ap.add_argument("--contexts", default="1024,2048,4096,8192")
    ap.add_argument("--batches", default="4", help="aggregate decode at these numbers of sequences")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--out", default="bench/decode_capture.json")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    res = {"machine": machine(), "model": args.model, "contexts": contexts, "new_tokens": args.new_tokens,
           "batches": batches,
           "captured": measure_headwise(args.model, False, contexts, args.new_tokens, args.runs, batches),
           "eager": measure_headwise(args.model, True, contexts, args.new_tokens, args.runs, batches)}
    if not args.no_llama_cpp:
        res["llama.cpp"] = measure_llama_cpp(args.model, contexts, args.new_tokens, args.runs)
    md = table(res)
    save(args.out, res, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
