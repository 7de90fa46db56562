"""Preemption under memory pressure, on the default model: does parking a preempted
sequence's KV in the tier pay? Many long requests under a KV budget too small for all of
them as they grow: the engine preempts the latest admitted, frees its KV (its full-head
blocks and window-state snapshots stay cached, or go to the disk tier when evicted) and
later resumes it from the longest cached prefix it finds, recomputing the rest. Counted:
preemptions, tokens computed again after a preemption (what parking its exact state
would have saved), and the share of the run's wall time those recomputations took at the
run's own prefill rate. Shipped layout without and with a disk tier, and `full`.

    python benchmarks/bench_preemption.py [--requests 16] [--prompt-tokens 4096]
        [--max-tokens 256] [--kv-gib 0.4] [--max-num-seqs 16] [--out bench/preemption.json]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, prompt_ids, save  # noqa: E402
from headwise import LLM, SamplingParams  # noqa: E402


def run(layout, args, offload_dir: str | None = None) -> dict:
    llm = LLM(head_layout=layout, kv_cache_memory=int(args.kv_gib * (1 << 30)), max_num_seqs=args.max_num_seqs,
              kv_offload_dir=offload_dir)
    eng = llm.engine
    tok = llm.tokenizer
    llm.generate(prompt_ids(tok, 256, 999), SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    prompts = [prompt_ids(tok, args.prompt_tokens, i) for i in range(args.requests)]
    counts = {"tokens": 0, "prefill_tokens": 0, "prefill_s": 0.0, "recomputed": 0}
    done: dict[int, int] = {}  # seq_id -> tokens computed once its scheduled chunk has run
    high: dict[int, int] = {}  # seq_id -> tokens it had computed when last preempted
    last_prefill = False  # whether the latest step carried a prefill chunk
    schedule = eng.scheduler.schedule

    def counted():  # the scheduler's output, counted; the engine runs it as usual
        nonlocal last_prefill
        out = schedule()
        for seq in out.preempted:
            high[seq.seq_id] = max(high.get(seq.seq_id, 0), done.get(seq.seq_id, 0))
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            done[seq.seq_id] = start + n
            if seq.seq_id in high:  # tokens it had computed before: computed again
                counts["recomputed"] += max(0, min(start + n, high[seq.seq_id]) - start)
            counts["tokens"] += n
            counts["prefill_tokens"] += n if n > 1 else 0
        last_prefill = any(n > 1 for _, n in out.scheduled)
        return out

    eng.scheduler.schedule = counted
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)
    t0 = time.perf_counter()
    seqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        if last_prefill:
            counts["prefill_s"] += time.perf_counter() - t
    wall = time.perf_counter() - t0
    llm.close()
    rate = counts["prefill_tokens"] / counts["prefill_s"] if counts["prefill_s"] else 0.0
    rec = {"preemptions": sum(s.num_preemptions for s in seqs), "wall_s": wall,
           "tokens_computed": counts["tokens"], "recomputed_tokens": counts["recomputed"],
           "prefill_tok_per_s": rate}
    # Upper bound: prefill steps also carry decode rows, so their rate understates prefill's.
    rec["recompute_s"] = counts["recomputed"] / rate if rate else 0.0
    rec["recompute_share"] = rec["recompute_s"] / wall
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--kv-gib", type=float, default=0.4)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--out", default="bench/preemption.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:  # layout None: the shipped one
        rows = {"headwise": run(None, args), "headwise + disk tier": run(None, args, d),
                "headwise-full": run("full", args)}
    head = ("| system | preemptions | tokens computed | recomputed after preemption | "
            "recompute s (upper bound) | share of wall time | wall s |\n|---|---|---|---|---|---|---|\n")
    table = head + "".join(
        f"| {k} | {r['preemptions']} | {r['tokens_computed']} | {r['recomputed_tokens']} | "
        f"{r['recompute_s']:.2f} | {100 * r['recompute_share']:.1f}% | {r['wall_s']:.1f} |\n" for k, r in rows.items())
    print(table)
    save(args.out, {"machine": machine(), "args": vars(args), "rows": rows}, table)


if __name__ == "__main__":
    main()
