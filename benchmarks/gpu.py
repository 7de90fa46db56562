"""GPU benchmark: a random-weight model with Llama-3-8B's shape, `full` vs a 25%-full
layout, plus the Triton decode/prefill kernels against PyTorch's SDPA on a contiguous cache.

    python benchmarks/gpu.py                       # H200: 32K, 64K, 128K contexts
    python benchmarks/gpu.py --tiny --device cpu   # smoke run of the harness on CPU

Layouts (--layouts): `full`, `split`, either with a KV cache dtype after a plus sign
(`split+fp8_e4m3`, `split+int8`). A layout that fails is reported and skipped.
Per layout and context: time to first token (one prefill, chunks of --chunk tokens),
decode tokens/s at batch 1, sequences that fit --budget-gib of KV cache, and aggregate
decode tokens/s with that many sequences (their caches are placed directly, as in
benchmarks/common.headwise_aggregate: decode cost depends on cache sizes, not values).
Kernel table: one layer's full-head attention at batch 1, Triton paged kernels (pages
scattered over the pool) against SDPA over a contiguous cache. Writes results.json and
results.md to --out-dir. Weights are random: no download, figures only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import headwise_aggregate, headwise_single  # noqa: E402
from headwise import LLM, HeadLayout  # noqa: E402
from headwise.cache.manager import KVCacheManager  # noqa: E402
from headwise.models.config import ModelConfig  # noqa: E402
from headwise.models.causal_lm import CausalLM  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0)
TINY = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0)


class IdTokenizer:
    """Token ids in, ids as text out: the benchmark feeds ids and never reads text."""
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        raise TypeError("this benchmark passes token ids, not text")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))  # no token is special here


def random_model(shape: dict, max_len: int, device: str, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    cfg = ModelConfig(architecture="llama", max_position_embeddings=max_len,
                      name="random-llama3-8b-shape", **shape)
    # Built on meta then materialised in `dtype` directly (an 8B float32 copy would not fit).
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = CausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.model.build_rotary(cfg, device)
    return model.eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_fn(fn, device: str, reps: int) -> float:
    """Median seconds of fn() over reps calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_layout(args, layout_name: str, contexts: list[int], dtype) -> list[dict]:
    base, _, kv = layout_name.partition("+")
    kv = kv or "auto"
    shape = TINY if args.tiny else LLAMA3_8B
    max_len = max(contexts) + args.new_tokens + args.agg_steps + 8
    model = random_model(shape, max_len, args.device, dtype)
    dims = (shape["num_layers"], shape["num_kv_heads"], shape["head_dim"])
    layout = (HeadLayout.full(dims) if base == "full"
              else HeadLayout.random(dims, args.full_fraction, seed=0, sink=args.sink, window=args.window))
    budget = int(args.budget_gib * (1 << 30))
    # One engine per layout, configured once as a server would be: ring slots for as many
    # sequences of the shortest context as the budget holds (the books alone, no storage).
    per_seq = KVCacheManager(layout, 16, budget, 1, dtype, kv_cache_dtype=kv).kv_bytes(
        min(contexts) + args.agg_steps + 2)
    llm = LLM.from_model(model, IdTokenizer(), head_layout=layout, dtype=args.dtype, device=args.device,
                         kv_cache_dtype=kv,
                         attention_backend=args.backend, max_num_batched_tokens=args.chunk,
                         max_model_len=max_len, kv_cache_memory=budget, max_num_seqs=max(1, budget // per_seq))
    records = []
    vocab = shape["vocab_size"]
    for L in contexts:
        ids = [(31 * j + 7) % (vocab - 1) + 1 for j in range(L)]
        ttft, tps = [], []
        for _ in range(args.runs):
            a, b = headwise_single(llm, ids, args.new_tokens)
            ttft.append(a)
            tps.append(b)
        conc = llm.engine.cache.max_concurrency(L + args.agg_steps + 2)
        agg = headwise_aggregate(llm, L, conc, args.agg_steps) if conc else 0.0
        rec = dict(layout=layout_name, context=L, ttft_s=statistics.median(ttft),
                   decode_tok_s=statistics.median(tps), kv_bytes_per_seq=llm.kv_bytes(L),
                   max_concurrency=conc, agg_tok_s=agg)
        print(f"{layout_name:14s} {L:7d}: TTFT {rec['ttft_s']:.3f} s, decode {rec['decode_tok_s']:.1f} tok/s, "
              f"KV {rec['kv_bytes_per_seq'] / 2**20:.1f} MiB, fit {conc}, agg {agg:.1f} tok/s", flush=True)
        records.append(rec)
    del llm, model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return records


def measure_kernels(args, contexts: list[int], dtype) -> list[dict]:
    """One layer's full-head attention at batch 1: Triton on scattered pages vs SDPA."""
    from headwise.kernels import triton_usable

    if not triton_usable(torch.device(args.device)):
        print("kernel table skipped: Triton cannot run on this device (set TRITON_INTERPRET=1 on CPU)")
        return []
    from headwise.kernels import triton_attention as ta

    shape = TINY if args.tiny else LLAMA3_8B
    Hq, Hkv, D = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    bs, dev, scale = 16, args.device, D ** -0.5
    out = []
    for L in contexts:
        nb = -(-L // bs)
        k = torch.randn(Hkv, nb * bs, D, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        table = torch.randperm(nb, device=dev).to(torch.int32)  # pages out of order
        pos = torch.arange(L, device=dev)
        slots = table[pos // bs].long() * bs + pos % bs
        kc, vc = k[:, slots].unsqueeze(0), v[:, slots].unsqueeze(0)  # contiguous [1, Hkv, L, D]
        q1 = torch.randn(1, Hq, D, device=dev, dtype=dtype)
        lens = torch.tensor([L], dtype=torch.int32, device=dev)
        dec_tri = time_fn(lambda: ta.paged_decode(q1, k, v, table[None], lens, bs, scale), dev, args.kernel_reps)
        dec_ref = time_fn(lambda: F.scaled_dot_product_attention(q1[:, :, None], kc, vc, scale=scale,
                                                                 enable_gqa=True), dev, args.kernel_reps)
        c = min(L, args.chunk)  # the last prefill chunk, attending over the whole context
        qc = torch.randn(c, Hq, D, device=dev, dtype=dtype)
        pre_tri = time_fn(lambda: ta.paged_prefill(qc, k, v, table, L - c, bs, scale), dev, args.kernel_reps)
        mask = torch.arange(L, device=dev)[None, :] <= torch.arange(L - c, L, device=dev)[:, None]
        qq = qc.transpose(0, 1)[None]
        pre_ref = time_fn(lambda: F.scaled_dot_product_attention(qq, kc, vc, attn_mask=mask, scale=scale,
                                                                 enable_gqa=True), dev, args.kernel_reps)
        rec = dict(context=L, decode_triton_ms=dec_tri * 1e3, decode_sdpa_ms=dec_ref * 1e3,
                   prefill_chunk=c, prefill_triton_ms=pre_tri * 1e3, prefill_sdpa_ms=pre_ref * 1e3)
        print(f"kernels {L:7d}: decode triton {rec['decode_triton_ms']:.3f} ms vs SDPA {rec['decode_sdpa_ms']:.3f} ms; "
              f"prefill chunk {c}: triton {rec['prefill_triton_ms']:.2f} ms vs SDPA {rec['prefill_sdpa_ms']:.2f} ms",
              flush=True)
        out.append(rec)
        del k, v, kc, vc
    return out


CAPTURE_MODES = (("eager", True), ("graphs", None), ("graphs+compile", False))  # (name, enforce_eager)


def measure_capture(args, context: int, dtype) -> list[dict]:
    """Decode of the split layout with the step eager (`enforce_eager=True`), replayed from
    CUDA graphs (the default on CUDA) and from graphs of the torch.compile'd body
    (`enforce_eager=False`): batch-1 and batch-8 decode tokens/s, capture and compile
    seconds, and whether greedy tokens equal eager's (bfloat16 random weights: graphs read
    block tables as wide as max_model_len, so split-K sums may round differently)."""
    from headwise import SamplingParams

    shape = TINY if args.tiny else LLAMA3_8B
    dims = (shape["num_layers"], shape["num_kv_heads"], shape["head_dim"])
    layout = HeadLayout.random(dims, args.full_fraction, seed=0, sink=args.sink, window=args.window)
    ids = [(31 * j + 7) % (shape["vocab_size"] - 1) + 1 for j in range(context)]
    max_len = context + args.new_tokens + args.agg_steps + 8
    out, eager_tokens = [], None
    for mode, eager in CAPTURE_MODES:
        model = random_model(shape, max_len, args.device, dtype)
        llm = LLM.from_model(model, IdTokenizer(), head_layout=layout, dtype=args.dtype, device=args.device,
                             attention_backend=args.backend, max_num_batched_tokens=args.chunk,
                             max_model_len=max_len, kv_cache_memory=int(args.budget_gib * (1 << 30)),
                             max_num_seqs=8, enforce_eager=eager)
        runner = llm.engine.runner
        graphs = runner.graphs is not None and runner.graphs.enabled
        tps = statistics.median(headwise_single(llm, ids, args.new_tokens)[1] for _ in range(args.runs))
        batch8 = headwise_aggregate(llm, context, 8, args.agg_steps)
        llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
        tokens = llm.generate([ids], params, use_tqdm=False)[0].token_ids
        eager_tokens = tokens if eager else eager_tokens
        rec = dict(context=context, mode=mode, graphs=graphs, compile_s=runner.forward.compile_s,
                   capture_s=runner.graphs.capture_s if graphs else 0.0, decode_tok_s=tps, batch8_tok_s=batch8,
                   same_tokens_as_eager=tokens == eager_tokens)
        print(f"capture {context:7d} {mode:14s}: graphs {graphs}, batch 1 {tps:.1f} tok/s, batch 8 {batch8:.1f} tok/s, "
              f"capture {rec['capture_s']:.1f} s, compile {rec['compile_s']:.1f} s, "
              f"tokens as eager {rec['same_tokens_as_eager']}", flush=True)
        out.append(rec)
        del llm, model, runner
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def markdown(records: list[dict], kernels: list[dict], args, capture: list[dict] = ()) -> str:
    by = {(r["layout"], r["context"]): r for r in records}
    lines = [f"Random-weight model, {'tiny' if args.tiny else 'Llama-3-8B'} shape, {args.dtype}, "
             f"device {args.device} ({_device_name(args.device)}), KV budget {args.budget_gib:g} GiB, "
             f"split layout {args.full_fraction:.0%} full heads (sink {args.sink}, window {args.window}).", "",
             "| context | layout | TTFT s | decode tok/s | KV/seq MiB | fit | agg tok/s |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['context']} | {r['layout']} | {r['ttft_s']:.3f} | {r['decode_tok_s']:.1f} | "
                     f"{r['kv_bytes_per_seq'] / 2**20:.1f} | {r['max_concurrency']} | {r['agg_tok_s']:.1f} |")
    lines += ["", "| context | TTFT speed-up | KV smaller | concurrency | aggregate |", "|---:|---:|---:|---:|---:|"]
    lines[-2] = "| context | layout vs full | TTFT speed-up | KV smaller | concurrency | aggregate |"
    lines[-1] = "|---:|---|---:|---:|---:|---:|"
    for L in sorted({r["context"] for r in records}):
        f = by.get(("full", L))
        for name in dict.fromkeys(r["layout"] for r in records if r["layout"] != "full"):
            s = by.get((name, L))
            if f and s:
                lines.append(f"| {L} | {name} | {f['ttft_s'] / s['ttft_s']:.2f}x | "
                             f"{f['kv_bytes_per_seq'] / s['kv_bytes_per_seq']:.2f}x | "
                             f"{s['max_concurrency'] / max(1, f['max_concurrency']):.2f}x | "
                             f"{s['agg_tok_s'] / max(1e-9, f['agg_tok_s']):.2f}x |")
    if kernels:
        lines += ["", "| context | decode Triton ms | decode SDPA ms | prefill chunk | prefill Triton ms | prefill SDPA ms |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for k in kernels:
            lines.append(f"| {k['context']} | {k['decode_triton_ms']:.3f} | {k['decode_sdpa_ms']:.3f} | "
                         f"{k['prefill_chunk']} | {k['prefill_triton_ms']:.2f} | {k['prefill_sdpa_ms']:.2f} |")
    if capture:
        lines += ["", "| context | decode step | graphs | decode tok/s (batch 1) | batch 8 tok/s | capture s | "
                  "compile s | tokens as eager |", "|---:|---|---|---:|---:|---:|---:|---|"]
        for c in capture:
            lines.append(f"| {c['context']} | {c['mode']} | {'yes' if c['graphs'] else 'no'} | "
                         f"{c['decode_tok_s']:.1f} | {c['batch8_tok_s']:.1f} | {c['capture_s']:.1f} | "
                         f"{c['compile_s']:.1f} | {'yes' if c['same_tokens_as_eager'] else 'no'} |")
    return "\n".join(lines) + "\n"


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--budget-gib", type=float, default=40.0)
    ap.add_argument("--full-fraction", type=float, default=0.25)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (engine step token budget)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--agg-steps", type=int, default=16)
    ap.add_argument("--kernel-reps", type=int, default=20)
    ap.add_argument("--layouts", default="full,split,split+fp8_e4m3",
                    help="comma-separated: full | split, optionally +KV_DTYPE (split+int8)")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--capture", action="store_true",
                    help="also decode eager vs CUDA graphs vs graphs + torch.compile at the shortest context")
    ap.add_argument("--tiny", action="store_true", help="tiny model shape (harness smoke test)")
    ap.add_argument("--out-dir", default="bench/gpu")
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here; use --device cpu (with --tiny) for a smoke run", file=sys.stderr)
        return 2
    records = []
    for name in args.layouts.split(","):
        try:
            records += measure_layout(args, name, contexts, dtype)
        except Exception as e:  # noqa: BLE001 -- one failing layout must not lose the others' figures
            print(f"{name}: failed ({type(e).__name__}: {e}); skipped", file=sys.stderr, flush=True)
    kernels = [] if args.no_kernels else measure_kernels(args, contexts, dtype)
    capture = measure_capture(args, min(contexts), dtype) if args.capture else []
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=_device_name(args.device), dtype=args.dtype, budget_gib=args.budget_gib,
                full_fraction=args.full_fraction, date=time.strftime("%Y-%m-%d"))
    (out / "results.json").write_text(json.dumps(dict(meta=meta, records=records, kernels=kernels,
                                                      capture=capture), indent=1))
    table = markdown(records, kernels, args, capture)
    (out / "results.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
