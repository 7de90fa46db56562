"""Scale-out routing on the default model: 20 chat requests over 4 documents (5 questions
each, shuffled), one after another, through Ray Serve on this machine:

- one engine (1 replica), the baseline a single `headwise serve` gives;
- 2 replicas, prefix-affinity routing (the default of `headwise serve --replicas 2`);
- 2 replicas, round-robin.

Per system: the prefix-cache hit rate (prompt tokens served from a cache / all prompt
tokens), how many follow-up questions found their document cached, and time to first token
(streamed). Every replica gets one thread (1 CPU), so the systems differ by routing only.

    python benchmarks/bench_ray_routing.py [--doc-tokens 1500] [--out bench/ray_routing.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from benchmarks.bench_prefix import QUESTIONS, prose  # noqa: E402
from benchmarks.common import machine, save  # noqa: E402
from headwise.server import ray_serve as R  # noqa: E402
from headwise.tokenizer import Tokenizer  # noqa: E402
from headwise.weights.loader import DEFAULT_MODEL_NAME, default_model_path  # noqa: E402
from headwise.weights.registry import cache_dir  # noqa: E402

SYSTEMS = (("one engine", "/one", 1, "prefix"), ("2 replicas, prefix affinity", "/prefix", 2, "prefix"),
           ("2 replicas, round-robin", "/rr", 2, "round-robin"))


def ask(url: str, doc: str, question: str) -> dict:
    body = {"messages": [{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}], "max_tokens": 4,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage = None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    return {"ttft_s": ttft, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--documents", type=int, default=4)
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--out", default="bench/ray_routing.json")
    a = ap.parse_args()
    path = default_model_path()
    tok = Tokenizer.from_path(path.parent, path.name, cache=cache_dir())
    docs = [prose(tok, a.doc_tokens, 5000 * i) for i in range(a.documents)]
    order = [(d, q) for q in QUESTIONS[:a.questions] for d in range(a.documents)]
    random.Random(0).shuffle(order)

    R.start_ray(None, num_cpus=2 * len(SYSTEMS))
    serve.start(http_options={"host": "127.0.0.1", "port": 8123}, logging_config=R.QUIET)
    opts = {"num_threads": 1, "kv_cache_memory": 1 << 29}
    for name, prefix, replicas, routing in SYSTEMS:
        serve.run(R.build_app(DEFAULT_MODEL_NAME, opts, replicas=replicas, routing=routing),
                  name=prefix.strip("/"), route_prefix=prefix)
    url = "http://127.0.0.1:8123"
    rows, records = [], []
    try:
        for name, prefix, replicas, routing in SYSTEMS:
            ask(url + prefix, "warm-up", "hello?")
            seen, res = set(), []
            for d, q in order:
                r = ask(url + prefix, docs[d], q)
                r["follow_up"] = d in seen
                seen.add(d)
                res.append(r)
                print(f"{name:<28} doc {d} {'follow-up' if r['follow_up'] else 'first    '} "
                      f"cached {r['cached_tokens']:>5}/{r['prompt_tokens']} ttft {r['ttft_s']:.3f}s", flush=True)
            follow = [r for r in res if r["follow_up"]]
            hit = sum(r["cached_tokens"] for r in res) / sum(r["prompt_tokens"] for r in res)
            hits = sum(r["cached_tokens"] >= a.doc_tokens * 0.9 for r in follow)
            rows.append((name, hit, hits, len(follow), statistics.median(r["ttft_s"] for r in follow),
                         statistics.mean(r["ttft_s"] for r in res)))
            records.append({"system": name, "replicas": replicas, "routing": routing, "requests": res})
    finally:
        serve.shutdown()
        ray.shutdown()
    lines = [f"Machine: {machine()}; {DEFAULT_MODEL_NAME}, shipped layout, 1 thread per replica; "
             f"{len(order)} chat requests over {a.documents} documents of ~{a.doc_tokens} tokens, one at a time",
             "", "| system | prefix-cache hit rate | follow-ups finding their document | follow-up TTFT (median) "
             "| TTFT (mean, all) |", "|---|---|---|---|---|"]
    for name, hit, hits, n, ttft_follow, ttft_all in rows:
        lines.append(f"| {name} | {hit:.1%} | {hits}/{n} | {ttft_follow:.3f} s | {ttft_all:.3f} s |")
    save(a.out, {"machine": machine(), "records": records}, "\n".join(lines))
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
