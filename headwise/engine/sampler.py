"""Turn logits into tokens: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from headwise.engine.sequence import Sequence


@dataclass
class SampleResult:
    token: int
    logprob: float | None  # None unless the request asks for logprobs
    top_logprobs: dict[int, float] | None


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
    # logits: [S, V] float32, one row per sequence. Logprobs are those of the model's raw
    # distribution (before temperature / top-k / top-p), as OpenAI-style servers report;
    # computed only when a request asks for them (a log-softmax over the vocabulary is
    # ~0.2 ms a step on the CPU at batch 1).
    wanted = any(s.params.logprobs is not None for s in seqs)
    logprobs = torch.log_softmax(logits, dim=-1) if wanted else None
    results = []
    greedy = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            tok = greedy[i]
        else:
            tok = _sample_row(logits[i], p.temperature, p.top_k, p.top_p, seq.generator)
        top = lp = None
        if p.logprobs is not None:
            lp = float(logprobs[i, tok])
            if p.logprobs:
                vals, idx = logprobs[i].topk(p.logprobs)
                top = dict(zip(idx.tolist(), vals.tolist()))
        results.append(SampleResult(tok, lp, top))
    return results


def _sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> int:
    x = logits / temperature
    if top_k > 0 and top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the top token).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
