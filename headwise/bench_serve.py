"""`headwise bench serve`: load a running server with streaming completions and report
request throughput, output tokens/s, and mean / median / p99 of TTFT, TPOT, ITL and
end-to-end latency (the figures vLLM's serving benchmark reports)."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from headwise.evaluation.passkey import FILLER



@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def _one(client, url: str, model: str, prompt, max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    res = Result(ok=False)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    res.error = d["error"]["message"]
                    return res
                if d.get("usage"):
                    res.output_tokens = d["usage"]["completion_tokens"]
                if d.get("choices") and d["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
    except Exception as e:  # connection errors count as failures, not crashes
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.ok = last is not None
    return res


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    s = sorted(xs)
    return {"mean": statistics.fmean(s), "median": statistics.median(s),
            "p99": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]}


async def run_bench(url: str, num_requests: int, concurrency: int, prompt_tokens: int, max_tokens: int,
                    request_rate: float | None = None, seed: int = 0) -> dict:
    import httpx

    url = url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        models = (await client.get(f"{url}/v1/models")).json()["data"]
        model = models[0]["id"]
        tok = (await client.post(f"{url}/tokenize", json={"prompt": FILLER * (prompt_tokens // 10 + 10)})).json()
        base = tok["tokens"]
        rng = random.Random(seed)
        prompts = []
        for i in range(num_requests):  # prompts of exactly prompt_tokens tokens, distinct from
            off = rng.randrange(0, 20)  # their first tokens on: no prefix-cache hits between them
            head = [rng.choice(base) for _ in range(8)]
            prompts.append(head + base[off: off + prompt_tokens - len(head)])
        sem = asyncio.Semaphore(concurrency)

        async def go(p, delay):
            await asyncio.sleep(delay)
            async with sem:
                return await _one(client, url, model, p, max_tokens)

        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if request_rate:
                t += rng.expovariate(request_rate)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(go(p, d) for p, d in zip(prompts, delays)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "model": model, "num_requests": num_requests, "concurrency": concurrency,
        "request_rate": request_rate, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": wall, "request_throughput": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
        "ttft_s": _stats([r.ttft for r in ok]), "tpot_s": _stats(tpot),
        "itl_s": _stats([x for r in ok for x in r.itl]), "e2e_s": _stats([r.e2e for r in ok]),
    }


def format_result(r: dict) -> str:
    def ms(d, k):
        return "-" if d[k] is None else f"{1000 * d[k]:.0f}"

    lines = [f"requests {r['completed']}/{r['num_requests']} ok, {r['failed']} failed, concurrency "
             f"{r['concurrency']}, {r['prompt_tokens']} prompt + {r['max_tokens']} output tokens",
             f"duration {r['duration_s']:.1f}s  request throughput {r['request_throughput']:.3f} req/s  "
             f"output {r['output_tokens_per_s']:.1f} tok/s",
             "metric (ms)   mean   median   p99"]
    for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        lines.append(f"{k[:-2]:<10} {ms(r[k], 'mean'):>7} {ms(r[k], 'median'):>8} {ms(r[k], 'p99'):>6}")
    if r["errors"]:
        lines.append("errors: " + "; ".join(r["errors"]))
    return "\n".join(lines)


def add_bench(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    s = bsub.add_parser("serve", help="load a running headwise (or any OpenAI-compatible) server")
    s.add_argument("--url", default="http://127.0.0.1:8000")
    s.add_argument("--num-requests", type=int, default=16)
    s.add_argument("--concurrency", type=int, default=4)
    s.add_argument("--request-rate", type=float, default=None, help="requests/s (Poisson); default: all at once")
    s.add_argument("--prompt-tokens", type=int, default=1024)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", default=None)
    s.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    for name in ("num_requests", "concurrency", "prompt_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    try:
        r = asyncio.run(run_bench(args.url, args.num_requests, args.concurrency, args.prompt_tokens,
                                  args.max_tokens, args.request_rate, args.seed))
    except OSError as e:
        raise ValueError(f"cannot reach the server at {args.url}: {e}") from None
    print(format_result(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if r["failed"] == 0 else 1
