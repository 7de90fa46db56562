"""Turn logits into tokens: logits processors (grammar masks, allowed token ids, bad
words, min_tokens, logit bias, penalties), then greedy, or temperature, min-p, top-k,
top-p with per-request seeds.

The processors run in vLLM's order: the structured-output mask, allowed_token_ids,
bad_words, min_tokens, logit_bias,
repetition / frequency / presence penalties; then temperature and min-p. Logprobs are
those of the model's raw distribution, before any of them, as vLLM reports by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from headwise.engine.grammar import GrammarCompiler
from headwise.engine.sequence import Sequence


@dataclass
class SampleResult:
    token: int | None  # None: the processors left no token to sample
    logprob: float | None  # None unless the request asks for logprobs
    top_logprobs: dict[int, float] | None


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: "set[int] | frozenset[int]" = frozenset(),
           grammar: GrammarCompiler | None = None) -> list[SampleResult]:
    # logits: [S, V] float32, one row per sequence. The raw logprobs are computed only
    # when a request asks for them (a log-softmax over the vocabulary is ~0.2 ms a step
    # on the CPU at batch 1).
    wanted = any(s.params.logprobs is not None for s in seqs)
    logprobs = torch.log_softmax(logits, dim=-1) if wanted else None
    if any(_processed(s) for s in seqs):
        logits = _process(logits.clone(), seqs, eos_ids, grammar)
    results = []
    greedy = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if _processed(seq) and logits[i].max() == float("-inf"):
            results.append(SampleResult(None, None, None))
            continue
        if p.greedy:
            tok = greedy[i]
        else:
            tok = _sample_row(logits[i], p.temperature, p.top_k, p.top_p, p.min_p, seq.generator)
        top = lp = None
        if p.logprobs is not None:
            lp = float(logprobs[i, tok])
            if p.logprobs:
                vals, idx = logprobs[i].topk(p.logprobs)
                top = dict(zip(idx.tolist(), vals.tolist()))
        results.append(SampleResult(tok, lp, top))
    return results


def _processed(seq: Sequence) -> bool:
    p = seq.params
    return (seq.matcher is not None or bool(p.logit_bias) or p.penalised or p.allowed_token_ids is not None
            or bool(seq.bad_word_ids) or len(seq.output_token_ids) < p.min_tokens)


def _process(logits: torch.Tensor, seqs: list[Sequence], eos_ids, grammar: GrammarCompiler | None) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if rows:
        if grammar is None:
            raise RuntimeError("a sequence has a grammar matcher but the sampler got no GrammarCompiler")
        grammar.mask(logits, rows, [seqs[i].matcher for i in rows])
    for i, seq in enumerate(seqs):
        p, x = seq.params, logits[i]
        if p.allowed_token_ids is not None:
            keep = x[p.allowed_token_ids]  # [len(allowed)], read before the row is masked
            x.fill_(float("-inf"))
            x[p.allowed_token_ids] = keep
        if seq.bad_word_ids:
            _ban_bad_words(x, seq)
        # A grammar that is complete allows only its end; that wins over min_tokens.
        if len(seq.output_token_ids) < p.min_tokens and not (seq.matcher is not None and seq.matcher.is_accepting()):
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            x[torch.tensor(sorted(stops), dtype=torch.long)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            x.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=x.dtype))
        if p.penalised:
            _penalise(x, seq)
    return logits


def bad_word_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Token ids of each word as written at the start of a text and after a space (the
    second only where the space joins the word's first token: as many tokens, a
    different first one; vLLM's rule)."""
    out = []
    for w in words:
        bare = tokenizer.encode(w.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
        out.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:  # the space joined the first token
            out.append(spaced)
    return out


def _ban_bad_words(x: torch.Tensor, seq: Sequence) -> None:
    # x: [V]. A word's last token is banned where the output ends with the ones before it.
    out = seq.output_token_ids
    for ids in seq.bad_word_ids:
        head = ids[:-1]
        if len(head) <= len(out) and out[len(out) - len(head):] == head:
            x[ids[-1]] = float("-inf")


def _penalise(x: torch.Tensor, seq: Sequence) -> None:
    # x: [V], edited in place. Counts are over the generated tokens (presence, frequency)
    # and over prompt + generated ones (repetition), as in vLLM.
    p = seq.params
    out = torch.tensor(seq.output_token_ids, dtype=torch.long)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(x.shape[0], dtype=torch.bool)
        seen[seq.prompt_ids_tensor()] = True
        seen[out] = True
        x[seen] = torch.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and out.numel():
        counts = torch.bincount(out, minlength=x.shape[0])[: x.shape[0]].to(x.dtype)
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def _sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                generator: torch.Generator | None) -> int:
    x = logits / temperature
    if min_p > 0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p * probs.max(), float("-inf"))
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
