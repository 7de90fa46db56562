"""`headwise demo`: one fact hidden in a ~6,000-token document, answered with every head
full (or, for a model with sliding-window layers, its native layout) and with the
head-split layout, side by side."""
from __future__ import annotations

from headwise.evaluation.passkey import passkey_prompt
from headwise.llm import LLM
from headwise.sampling import SamplingParams


# Tokens each layout generates: one generation serves both figures, a fixed number of
# tokens (no early stop) for the decode speed, and its first line as the answer.
NEW_TOKENS = 33


def _run(llm, prompt) -> dict:
    out = llm.generate(prompt.text, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    answer = out.text.strip().split("\n")[0]
    return {
        "answer": answer,
        "correct": prompt.answer in answer,
        "prompt_tokens": len(out.prompt_token_ids),
        "ttft_s": out.ttft_s,
        "decode_tok_s": (len(out.token_ids) - 1) / (out.latency_s - out.ttft_s),
        "kv_bytes": llm.kv_bytes(len(out.prompt_token_ids) + len(out.token_ids)),
        "full_fraction": llm.layout.full_fraction,
    }


def run_demo(model: str | None, tokens: int, options: dict) -> int:
    """options: engine options (LLM keyword arguments); head_layout is the split to show."""
    opts = dict(options)
    opts["max_num_batched_tokens"] = max(opts["max_num_batched_tokens"], 8192)
    split_choice = opts.pop("head_layout")
    rows = []
    llm = LLM(model, head_layout="native", **opts)  # every head full, unless the model slides
    prompt = passkey_prompt(llm.tokenizer, tokens, depth=0.4, seed=7)
    print(f"document: {len(llm.tokenizer.encode(prompt.text))} tokens, "
          f"pass key hidden at 40% depth; asking for it.\n", flush=True)
    ref_fraction = llm.layout.full_fraction
    rows.append((llm.layout.name, _run(llm, prompt)))
    del llm
    split = LLM(model, head_layout=split_choice, **opts)
    if split.layout.full_fraction < ref_fraction:
        rows.append((f"head-split ({split.layout.name})", _run(split, prompt)))
    else:
        print("(no head-split layout for this model; pass --head-layout PATH|window)\n")
    _print_table(rows, prompt.answer)
    return 0 if all(r["correct"] for _, r in rows) else 1


def _print_table(rows, answer: str) -> None:
    print(f"expected answer: {answer}")
    w = max(34, *(len(name) for name, _ in rows))
    hdr = f"{'layout':<{w}} {'full heads':>10} {'TTFT s':>8} {'decode tok/s':>13} {'KV MiB':>8}  answer"
    print(hdr)
    print("-" * len(hdr))
    for name, r in rows:
        print(f"{name:<{w}} {r['full_fraction']:>10.1%} {r['ttft_s']:>8.2f} {r['decode_tok_s']:>13.1f} "
              f"{r['kv_bytes'] / 2**20:>8.1f}  {r['answer']!r} {'(correct)' if r['correct'] else '(WRONG)'}")
    if len(rows) == 2:
        a, b = rows[0][1], rows[1][1]
        print(f"\nhead-split vs {rows[0][0]}: TTFT {a['ttft_s'] / b['ttft_s']:.2f}x faster, "
              f"KV {a['kv_bytes'] / b['kv_bytes']:.2f}x smaller, decode {b['decode_tok_s'] / a['decode_tok_s']:.2f}x")

