"""Prefix caching on the default model, in one run:

- Document QA: a ~6,000-token document of English prose (Debian's license texts) asked
  8 questions one after another, as chat messages. Per request: time to first token and
  prompt tokens actually computed.
- Chat: 6 turns, each adding ~1,000 tokens of prose and a question, growing to ~6,000
  tokens; the assistant answers are fixed (generated once, greedy) so every system sees
  the very same prompts.
- Each for headwise with the shipped layout and with `full`, prefix caching on and off,
  and for llama.cpp (llama-cpp-python on the same GGUF, its RAM prompt cache set).
- Capacity: how many distinct cached 6,000-token documents stay resident in a 2 GiB KV
  budget (a follow-up question then recomputes under 5% of its document), counted by the
  engine's own scheduler and cache manager with the model step left out: which prefixes
  stay cached does not depend on the KV values.

    python benchmarks/bench_prefix.py [--doc-tokens 6000] [--questions 8] [--turns 6]
        [--systems headwise,headwise-full,llama.cpp] [--out bench/prefix.json]
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import machine, save  # noqa: E402
from headwise import LLM, SamplingParams  # noqa: E402
from headwise.heads.layout import HeadLayout  # noqa: E402
from headwise.cache.manager import KVCacheManager  # noqa: E402
from headwise.engine.scheduler import Scheduler  # noqa: E402
from headwise.engine.sequence import Sequence  # noqa: E402
from headwise.evaluation.tasks import Haystack, prose_sentences  # noqa: E402
from headwise.layouts import shipped_layout  # noqa: E402
from headwise.weights.loader import DEFAULT_MODEL_NAME, default_model_path  # noqa: E402

QUESTIONS = ["What is this text about?", "Who may copy or distribute the work?",
             "What must be kept with every copy?", "Is there any warranty?",
             "What happens if you break the terms?", "Which versions does it mention?",
             "Summarise the main obligations in one sentence.", "What does it say about patents?"]
ANSWER_TOKENS = 32  # chat: length of each fixed assistant answer
NEW_TOKENS = 8      # tokens generated per measured request (TTFT is the point)


def prose(tokenizer, num_tokens: int, start: int) -> str:
    return "".join(Haystack(tokenizer, prose_sentences()).take(num_tokens, start))


def workloads(tok, doc_tokens: int, questions: int, turns: int):
    """(document QA prompts, chat prompts) as token ids, identical for every system."""
    doc = prose(tok, doc_tokens, 0)
    qa = [tok.encode_chat([{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}])
          for q in (QUESTIONS * 2)[:questions]]
    per_turn = doc_tokens // turns
    answerer = LLM(head_layout="full", enable_prefix_caching=False, max_num_batched_tokens=8192)
    msgs, chat = [], []
    for t in range(turns):
        msgs.append({"role": "user", "content": prose(tok, per_turn, 400 * (t + 1))
                     + "\n\nWhat does this part add? One sentence."})
        ids = tok.encode_chat(msgs)
        chat.append(ids)
        out = answerer.generate(ids, SamplingParams(max_tokens=ANSWER_TOKENS), use_tqdm=False)[0]
        msgs.append({"role": "assistant", "content": out.text.strip() or "Noted."})
    del answerer
    gc.collect()
    return qa, chat


def run_headwise(layout, caching: bool, prompts: dict[str, list[list[int]]]) -> dict[str, list[dict]]:
    llm = LLM(head_layout=layout, enable_prefix_caching=caching, max_num_batched_tokens=2048,
              kv_cache_memory=2 << 30, max_num_seqs=8)
    llm.generate(prompts["qa"][0][:200], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    out = {}
    for name, ps in prompts.items():
        rows = []
        for ids in ps:
            r = llm.generate(ids, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)[0]
            rows.append({"prompt": len(ids), "computed": len(ids) - r.num_cached_tokens, "ttft": r.ttft_s})
        out[name] = rows
        llm.reset_prefix_cache()  # each workload starts cold
    del llm
    gc.collect()
    return out


def run_llamacpp(prompts: dict[str, list[list[int]]], threads: int) -> dict[str, list[dict]]:
    from llama_cpp import Llama, LlamaRAMCache

    out = {}
    for name, ps in prompts.items():
        llm = Llama(str(default_model_path()), n_ctx=8192, n_threads=threads, n_threads_batch=threads,
                    n_batch=2048, verbose=False)
        llm.set_cache(LlamaRAMCache(capacity_bytes=2 << 30))
        list(llm.create_completion(ps[0][:200], max_tokens=2, stream=True))  # warm-up
        llm.reset()
        rows = []
        for ids in ps:
            t0 = time.perf_counter()
            stream = llm.create_completion(ids, max_tokens=NEW_TOKENS, temperature=0.0, stream=True)
            next(stream)
            ttft = time.perf_counter() - t0
            for _ in stream:
                pass
            rows.append({"prompt": len(ids), "computed": None, "ttft": ttft})
        out[name] = rows
        del llm
        gc.collect()
    return out


def resident_documents(layout, budget: int, doc_tokens: int, max_num_seqs: int, dtype,
                       num_docs: int = 80) -> tuple[int, float]:
    """Most distinct documents resident at once (a follow-up recomputes < 5% of its
    document) while documents arrive one after another, and the cached bytes per
    document then. Scheduler and cache books only."""
    cache = KVCacheManager(layout, 16, budget, max_num_seqs, dtype, enable_prefix_caching=True)
    sched = Scheduler(cache, max_num_seqs, 2048)
    rng = random.Random(0)
    question = [rng.randrange(100, 40000) for _ in range(24)]
    docs, best, per_doc = [], 0, 0.0
    for _ in range(num_docs):
        docs.append([rng.randrange(100, 40000) for _ in range(doc_tokens)])
        seq = Sequence(docs[-1] + question, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        sched.add(seq)
        while sched.has_unfinished():
            out = sched.schedule()
            cache.ops_done(cache.pop_ops())
            for s, n in out.scheduled:
                s.num_computed_tokens += n
                cache.commit(s.seq_id, s.token_ids, s.num_computed_tokens)
                if s.num_computed_tokens == s.num_tokens:
                    s.output_token_ids.append(7)
                    if len(s.output_token_ids) >= s.params.max_tokens:
                        sched.finish(s)
            cache.ops_done(cache.pop_ops())
        follow = [d + question[::-1] for d in docs]
        resident = sum(cache.match_prefix(f).num_tokens >= 0.95 * doc_tokens for f in follow)
        if resident > best:
            usage = cache.usage()
            best, per_doc = resident, (usage["paged"]["cached_bytes"] + usage["ring"]["cached_bytes"]) / resident
    return best, per_doc


def fmt_rows(results: dict, workload: str, systems: list[str]) -> str:
    head = "| request | prompt tokens | " + " | ".join(f"{s} TTFT s (computed)" for s in systems) + " |"
    lines = [head, "|" + "---|" * (2 + len(systems))]
    n = len(results[systems[0]][workload])
    for i in range(n):
        cells = []
        for s in systems:
            r = results[s][workload][i]
            comp = "" if r["computed"] is None else f" ({r['computed']})"
            cells.append(f"{r['ttft']:.2f}{comp}")
        lines.append(f"| {i + 1} | {results[systems[0]][workload][i]['prompt']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-tokens", type=int, default=6000)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--systems", default="headwise,headwise-full,llama.cpp")
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--out", default="bench/prefix.json")
    a = ap.parse_args(argv)
    systems = a.systems.split(",")
    shape = (30, 3, 64)
    shipped = shipped_layout(DEFAULT_MODEL_NAME, shape)
    layouts = {"headwise": shipped, "headwise-full": HeadLayout.full(shape, DEFAULT_MODEL_NAME)}
    probe = LLM(head_layout="full", kv_cache_memory=1 << 26)
    tok, dtype = probe.tokenizer, probe.engine.dtype
    del probe
    qa, chat = workloads(tok, a.doc_tokens, a.questions, a.turns)
    prompts = {"qa": qa, "chat": chat}
    print(f"document QA: {len(qa)} prompts of {len(qa[0])}-{len(qa[-1])} tokens; "
          f"chat: {len(chat)} turns, {len(chat[0])} to {len(chat[-1])} tokens", flush=True)
    results, cols = {}, []
    for s in systems:
        if s == "llama.cpp":
            try:
                results[s] = run_llamacpp(prompts, torch.get_num_threads())
            except ImportError:
                print("llama-cpp-python is not installed; its column is skipped (make bench builds it)")
                continue
            cols.append(s)
            continue
        for caching in (True, False):
            col = f"{s} {'on' if caching else 'off'}"
            results[col] = run_headwise(layouts[s], caching, prompts)
            cols.append(col)
            print(col, [round(r["ttft"], 2) for r in results[col]["qa"]], flush=True)
    budget = int(a.budget_gib * 2**30)
    capacity = {}
    for name, layout in layouts.items():
        for seqs in (4, 32):
            capacity[(name, seqs)] = resident_documents(layout, budget, a.doc_tokens, seqs, dtype)
    lines = [f"Machine: {machine()}; {dtype}; KV budget {a.budget_gib:g} GiB; headwise = shipped layout "
             f"({shipped.name}), headwise-full = every head full; {NEW_TOKENS} new tokens per request", "",
             f"Document QA ({len(qa)} questions about one {a.doc_tokens}-token document):", "",
             fmt_rows(results, "qa", cols), "",
             f"Chat ({len(chat)} turns, growing):", "", fmt_rows(results, "chat", cols), "",
             f"Resident cached {a.doc_tokens}-token documents in {a.budget_gib:g} GiB "
             "(a follow-up question recomputes < 5% of its document):", "",
             "| layout | max_num_seqs | cached MiB per document | resident documents | vs full |",
             "|---|---|---|---|---|"]
    for (name, seqs), (n, per) in capacity.items():
        full_n = capacity[("headwise-full", seqs)][0]
        lines.append(f"| {name} | {seqs} | {per / 2**20:.1f} | {n} | {n / full_n:.2f}x |")
    summary = []
    for col in cols:
        qa_rows = results[col]["qa"]
        follow = sorted(r["ttft"] for r in qa_rows[1:])
        summary.append(f"- {col}: first request {qa_rows[0]['ttft']:.2f} s, follow-ups median "
                       f"{follow[len(follow) // 2]:.2f} s ({qa_rows[0]['ttft'] / follow[len(follow) // 2]:.1f}x); "
                       f"last chat turn {results[col]['chat'][-1]['ttft']:.2f} s")
    table = "\n".join(lines + [""] + summary)
    print(table)
    payload = {"machine": machine(), "results": results,
               "capacity": [{"layout": k[0], "max_num_seqs": k[1], "resident": v[0], "bytes_per_doc": v[1]}
                            for k, v in capacity.items()]}
    save(a.out, payload, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
