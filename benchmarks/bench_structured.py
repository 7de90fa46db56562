"""Structured outputs on the default model, in one run:

- Aggregate decode of 16 sequences at once, free and constrained by a JSON schema (the
  same chat prompts; the schema forces a long array, so every sequence keeps decoding
  through the timed steps). Decode steps are timed after every prompt is prefilled.
- What the constraint costs per step: the time to fill and apply the 16 token masks.
- The two grammar libraries vLLM offers, on this tokenizer: llguidance (used) and
  xgrammar (timed only when installed: `pip install xgrammar`): tokenizer set-up, schema
  compile, and mask time per token along a valid JSON document.

    python benchmarks/bench_structured.py [--seqs 16] [--steps 32] [--out bench/structured.json]
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import machine, save  # noqa: E402
from headwise import LLM, SamplingParams  # noqa: E402
from headwise.structured import StructuredOutputs  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "numbers": {"type": "array", "minItems": 60, "items": {"type": "integer", "minimum": 0, "maximum": 999}}},
    "required": ["title", "numbers"], "additionalProperties": False}
DOC = {"parties": ["Acme Corp", "Globex Ltd"], "date": "2026-01-02", "amount": 125000.5, "currency": "EUR",
       "signed": True, "items": [{"sku": "ABC-12", "qty": 3}, {"sku": "XYZ-07", "qty": 1}]}
DOC_SCHEMA = {"type": "object", "properties": {
    "parties": {"type": "array", "items": {"type": "string"}}, "date": {"type": "string", "format": "date"},
    "amount": {"type": "number"}, "currency": {"enum": ["USD", "EUR", "GBP"]}, "signed": {"type": "boolean"},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
    "required": list(DOC), "additionalProperties": False}


def decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams, steps: int) -> tuple[float, float]:
    """(aggregate decode tokens/s over `steps` steps once every prompt is prefilled, mask ms per step)."""
    eng = llm.engine
    llm.reset_prefix_cache()
    seqs = [eng.add_request(p, params) for p in prompts]
    while not all(s.output_token_ids for s in seqs):
        eng.step()
    masked = []
    real = eng.grammar.mask

    def timed(*a):
        t = time.perf_counter()
        real(*a)
        masked.append(time.perf_counter() - t)

    eng.grammar.mask = timed
    try:
        t0 = time.perf_counter()
        done = 0
        for _ in range(steps):
            done += len(eng.step())
        dt = time.perf_counter() - t0
    finally:
        eng.grammar.mask = real
    if any(s.is_finished for s in seqs):
        raise RuntimeError("a sequence finished inside the timed steps; raise the schema's minItems")
    for s in seqs:
        eng.abort(s)
    return done / dt, 1e3 * sum(masked) / steps


def libraries(tokenizer, vocab: int) -> list[dict]:
    doc = json.dumps(DOC)
    schema = json.dumps(DOC_SCHEMA)
    ids = tokenizer.encode(doc, add_special_tokens=False)
    rows = []
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab)
    t1 = time.perf_counter()
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    t2 = time.perf_counter()
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = []
    for i in ids:
        a = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - a)
        assert m.consume_token(i), m.get_error()
    rows.append({"library": f"llguidance {importlib.metadata.version('llguidance')}", "tokenizer_s": t1 - t0, "compile_ms": 1e3 * (t2 - t1),
                 "first_mask_ms": 1e3 * times[0], "mask_ms_median": 1e3 * statistics.median(times[1:])})
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar is not installed; its row is skipped (pip install xgrammar)")
        return rows
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab)
    comp = xgr.GrammarCompiler(info, max_threads=torch.get_num_threads())
    t1 = time.perf_counter()
    g = comp.compile_json_schema(schema)
    t2 = time.perf_counter()
    xm = xgr.GrammarMatcher(g)
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for i in ids:
        a = time.perf_counter()
        xm.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - a)
        assert xm.accept_token(i)
    rows.append({"library": f"xgrammar {importlib.metadata.version('xgrammar')}", "tokenizer_s": t1 - t0, "compile_ms": 1e3 * (t2 - t1),
                 "first_mask_ms": 1e3 * times[0], "mask_ms_median": 1e3 * statistics.median(times[1:])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default="bench/structured.json")
    args = ap.parse_args()
    llm = LLM(max_num_seqs=args.seqs)
    tok = llm.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": f"Invoice {i}: list the first numbers you think "
                                 "of, with a short title, as JSON."}]) for i in range(args.seqs)]
    # The free run decodes as long as the constrained one: EOS ignored, the same budget.
    free = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0.8, seed=1)
    schema = SamplingParams(max_tokens=args.steps + 8, temperature=0.8, seed=1,
                            structured_outputs=StructuredOutputs(json=SCHEMA))
    decode_rate(llm, prompts, free, 4)  # warm-up (decode capture, grammar tokenizer)
    decode_rate(llm, prompts, schema, 4)
    runs = {"free": [], "json_schema": []}
    masks = []
    for _ in range(3):
        runs["free"].append(decode_rate(llm, prompts, free, args.steps)[0])
        rate, mask_ms = decode_rate(llm, prompts, schema, args.steps)
        runs["json_schema"].append(rate)
        masks.append(mask_ms)
    f, c = statistics.median(runs["free"]), statistics.median(runs["json_schema"])
    libs = libraries(tok, llm.engine.model_config.vocab_size)
    lines = [f"Structured outputs, {llm.engine.model_name} (layout {llm.layout.name}), {args.seqs} sequences, "
             f"{args.steps} timed decode steps, median of 3; {machine()}", "",
             "| decode | aggregate tok/s | vs free | token masks, ms per step |", "|---|---|---|---|",
             f"| free | {f:.1f} | 1.00x | - |",
             f"| JSON schema | {c:.1f} | {c / f:.2f}x | {statistics.median(masks):.2f} |", "",
             "| library | tokenizer set-up s | schema compile ms | first mask ms | mask ms per token (median) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['library']} | {r['tokenizer_s']:.2f} | {r['compile_ms']:.2f} | {r['first_mask_ms']:.3f} | "
              f"{r['mask_ms_median']:.3f} |" for r in libs]
    table = "\n".join(lines)
    print(table)
    save(args.out, {"machine": machine(), "seqs": args.seqs, "steps": args.steps, "runs": runs,
                    "mask_ms_per_step": masks, "libraries": libs}, table)


if __name__ == "__main__":
    main()
