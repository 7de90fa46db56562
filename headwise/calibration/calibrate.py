"""`headwise calibrate`: decide which KV heads stay full.

Three methods rank the candidate heads (docs/quality.md compares them on the quality suite):
- "gates" (the default): a gate per KV head mixing its full and sink + window outputs,
  trained by distillation with an L1 pull toward window (calibration.gates, after
  DuoAttention).
- "mass": the attention mass the answer positions put outside sink + window (the
  training-free profile RedKnot uses); for a KV head, the largest over its query heads.
- "ablation", described below.
All three read the same calibration prompts (calibration.samples), held out from the
quality suite.

Ablation (training-free):
1. Run retrieval prompts with their answers appended. At the answer positions, for every
   KV head, compare the head's attention output under full attention with its output
   under the sink + window mask, projected through the head's slice of o_proj, i.e. the
   change windowing that head makes to the residual stream exactly where the answer is
   produced. Scores are normalised per prompt and averaged.
2. Keep the top fraction full; then re-score with that layout in place (later layers now
   see the windowed earlier layers) and re-select, a few rounds, so heads that only matter
   once others are windowed are caught.
The attention mass that answer positions put on the needle is recorded too (the simple
baseline), so both rankings can be compared.

On a model with sliding-window layers (Gemma 3) those layers keep their native window
heads: only the heads of the full-attention layers are candidates, scored on top of the
native layout, and `full_fraction` is the fraction of those heads that stays full. A
layout stores no score (null) for a head that was not a candidate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from headwise.heads.layout import DEFAULT_SINK, DEFAULT_WINDOW, HeadLayout, HeadSpec
from headwise.calibration.gates import GateSample, train_gates
from headwise.calibration.samples import KINDS, CalibSample, make_samples
from headwise.layouts import native_layout
from headwise.llm import LLM
from headwise.weights.loader import load_model, read_model_config

METHODS = ("gates", "mass", "ablation")
# Prompt lengths by method: a gate step is a forward and backward pass over one prompt, so
# gates train on shorter ones (still past sink + window for most needle depths).
DEFAULT_LENGTHS = {"gates": (1024, 1536), "mass": (1024, 2048, 3072), "ablation": (1024, 2048, 3072)}


@dataclass
class HeadScores:
    deviation: torch.Tensor   # [L, H] mean normalised output change when windowed
    needle_mass: torch.Tensor  # [L, H] mean attention mass on the needle
    outside_mass: torch.Tensor  # [L, H] mean attention mass outside sink + window (max over the group)


class _Probe:
    """Per-layer observer accumulating scores for one sample at a time."""

    def __init__(self, layer: int, o_proj: torch.Tensor, order: list[int], group: int,
                 sink: int, window: int, scale: float) -> None:
        self.layer, self.o_proj, self.order, self.group = layer, o_proj, order, group
        self.scale = scale
        self.sink, self.window = sink, window
        self.rows: list[int] = []
        self.needle: list[int] = []
        self.dev = torch.zeros(len(order))
        self.mass = torch.zeros(len(order))
        self.outside = torch.zeros(len(order))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] in storage order (see head_order)
        rows = torch.tensor(self.rows)
        T, Hq, D = q.shape
        g = self.group
        qq = q[rows].float().transpose(0, 1)                       # [Hq, R, D]
        kk = k.float().repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, T, D]
        vv = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
        s = qq @ kk.transpose(1, 2) * self.scale                    # [Hq, R, T]
        j = torch.arange(T)[None, :]
        i = rows[:, None]
        causal = j <= i
        win = causal & ((j < self.sink) | (j > i - self.window))
        pf = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        pw = torch.softmax(s.masked_fill(~win, float("-inf")), -1)
        delta = (pf - pw) @ vv                                      # [Hq, R, D]
        W = self.o_proj.float().view(-1, Hq, D)                     # [hidden, Hq, D]
        proj = torch.einsum("hrd,ohd->hro", delta, W)               # [Hq, R, hidden]
        dev = proj.norm(dim=-1).mean(-1).view(-1, g).sum(-1)        # [Hkv]
        mass = pf[:, :, self.needle].sum(-1).mean(-1).view(-1, g).mean(-1) if self.needle else torch.zeros(len(self.order))
        outside = pf.masked_fill(win, 0).sum(-1).mean(-1).view(-1, g).amax(-1)  # [Hkv]
        for pos, head in enumerate(self.order):
            self.dev[head] += dev[pos]
            self.mass[head] += mass[pos]
            self.outside[head] += outside[pos]


def score_heads(llm, samples: list[CalibSample], sink: int, window: int, progress=None) -> HeadScores:
    """Score every (layer, KV head) of the engine's model on the samples; zero for the
    layers of a sliding window (not candidates, not probed)."""
    eng = llm.engine
    cfg = eng.model_config
    attn_layers = eng.model.attention_layers()
    probes = []
    fixed = set(cfg.sliding_layers)
    for l, (layer, attn) in enumerate(zip(eng.model.model.layers, attn_layers)):
        p = _Probe(l, layer.self_attn.o_proj.dense_weight(), eng.layout.head_order(l),
                   cfg.group_size, sink, window, attn.scale)
        if l not in fixed:
            attn.observer = p
        probes.append(p)
    dev = torch.zeros(cfg.num_layers, cfg.num_kv_heads)
    mass, outside = torch.zeros_like(dev), torch.zeros_like(dev)
    try:
        for s in samples:
            for p in probes:
                p.rows, p.needle = s.query_rows, s.needle_rows
                p.dev.zero_(), p.mass.zero_(), p.outside.zero_()
            eng.prompt_logits(s.ids, chunk_size=len(s.ids), positions=[])
            d = torch.stack([p.dev for p in probes])
            dev += d / d.max()
            mass += torch.stack([p.mass for p in probes])
            outside += torch.stack([p.outside for p in probes])
            if progress is not None:
                progress.update(1)
    finally:
        for attn in attn_layers:
            attn.observer = None
    return HeadScores(dev / len(samples), mass / len(samples), outside / len(samples))


def _top(scores: torch.Tensor, k: int, candidate: torch.Tensor) -> set[tuple[int, int]]:
    # scores, candidate: [L, H]; the k best-scored candidate heads
    L, H = scores.shape
    idx = scores.masked_fill(~candidate, float("-inf")).flatten().argsort(descending=True)[:k].tolist()
    return {(i // H, i % H) for i in idx}


def _split(name: str, base: HeadLayout, candidate: torch.Tensor, full: set[tuple[int, int]],
           sink: int, window: int, scores: list[list[float | None]] | None = None) -> HeadLayout:
    """`base` with its candidate heads made full (those in `full`) or sink + window."""
    heads = [[(HeadSpec("full") if (l, h) in full else HeadSpec("window", sink, window))
              if candidate[l, h] else spec for h, spec in enumerate(row)] for l, row in enumerate(base.heads)]
    return HeadLayout(name, *base.shape, heads, model=base.model, scores=scores)


def _check(full_fraction: float, sink: int, window: int, method: str = METHODS[0]) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; choose from {', '.join(METHODS)}")
    if not 0.0 <= full_fraction <= 1.0:
        raise ValueError(f"full_fraction must be in [0, 1], got {full_fraction}")
    if window < 1 or sink < 0:
        raise ValueError(f"need window >= 1 and sink >= 0, got sink={sink}, window={window}")


def select_from_scores(scored: HeadLayout, full_fraction: float, sink: int = DEFAULT_SINK,
                       window: int = DEFAULT_WINDOW, name: str | None = None) -> HeadLayout:
    """A layout from the per-head scores a calibrated layout stores, without running the
    model again: the top `full_fraction` of heads full, the rest sink + window."""
    _check(full_fraction, sink, window)
    if scored.scores is None:
        raise ValueError(f"layout {scored.name!r} stores no calibration scores")
    candidate = torch.tensor([[x is not None for x in row] for row in scored.scores])
    scores = torch.tensor([[0.0 if x is None else x for x in row] for row in scored.scores])
    k = round(full_fraction * int(candidate.sum()))
    return _split(name or f"calibrated-{full_fraction:g}-w{window}", scored, candidate,
                  _top(scores, k, candidate), sink, window, scored.scores)


def gate_dtype(name: str) -> torch.dtype:
    """The weights' dtype while gates train, from the engine's --dtype: auto is float32
    (every shipped layout's gates but Qwen 1.5B's were trained so); bfloat16 is faster on a
    CPU with bfloat16 matmuls (docs/quality.md, "Gate training time")."""
    if name in ("auto", "float32"):
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    raise ValueError(f"gate training runs in float32 or bfloat16 (--dtype auto, float32 or bfloat16), got {name!r}")


def calibrate(model: str | None = None, full_fraction: float = 0.25, sink: int = DEFAULT_SINK,
              window: int = DEFAULT_WINDOW, seed: int = 0, num_samples: int = 24,
              lengths: tuple[int, ...] | None = None, rounds: int = 2,
              progress: bool = True, engine_options: dict | None = None, method: str = "gates",
              steps: int = 64, lr: float = 0.05, l1: float = 0.05,
              kinds: tuple[str, ...] = KINDS) -> HeadLayout:
    """Find a layout keeping `full_fraction` of the candidate KV heads full (every head,
    or those of the full-attention layers of a model with sliding-window layers), ranked by
    `method` (METHODS), on prompts of `lengths` (default DEFAULT_LENGTHS) and of `kinds`
    (calibration.samples). rounds: re-scoring rounds of "ablation"; steps, lr, l1: the gate
    training of "gates" (calibration.gates). Deterministic for a seed."""
    _check(full_fraction, sink, window, method)
    engine_options = engine_options or {}
    # The gates' weight dtype, checked before any model loads.
    weights_dtype = gate_dtype(engine_options.get("dtype", "auto")) if method == "gates" else None
    lengths = tuple(lengths or DEFAULT_LENGTHS[method])
    torch.manual_seed(seed)
    mcfg = read_model_config(model)
    shape = (mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim)
    base = native_layout(mcfg) or HeadLayout.full(shape, mcfg.name)
    candidate = torch.tensor([[s.kind == "full" for s in row] for row in base.heads])
    k = round(full_fraction * int(candidate.sum()))
    name = f"calibrated-{method}-{full_fraction:g}"
    if method == "gates":
        if engine_options.get("num_threads"):
            torch.set_num_threads(engine_options["num_threads"])
        net, tokenizer = load_model(model, weights_dtype)
        samples = make_samples(tokenizer, num_samples, lengths, seed, kinds)
        bar = tqdm(total=steps, desc="training gates", unit="step", disable=not progress)
        fixed = {l: (0, mcfg.sliding_window) for l in mcfg.sliding_layers}
        result = train_gates(net, [GateSample(s.ids, s.query_rows) for s in samples], candidate, fixed,
                             sink, window, steps, lr, l1, seed, progress=bar)
        scores = result.ranking
    else:
        opts = dict(engine_options)
        opts["max_num_batched_tokens"] = max(opts.get("max_num_batched_tokens", 0), max(lengths) + 64)
        llm = LLM(model, head_layout=base, **opts)
        samples = make_samples(llm.tokenizer, num_samples, lengths, seed, kinds)
        rounds = rounds if method == "ablation" else 0
        bar = tqdm(total=num_samples * (1 + rounds), desc="calibrating", unit="prompt", disable=not progress)
        first = score_heads(llm, samples, sink, window, bar)
        scores = first.deviation if method == "ablation" else first.outside_mass
        for _ in range(rounds):
            split = LLM(model, head_layout=_split(name, base, candidate, _top(scores, k, candidate), sink, window),
                        **opts)
            again = score_heads(split, samples, sink, window, bar)
            del split
            # Blend: a head is kept if it matters with every head full or with this split.
            scores = 0.5 * first.deviation + 0.5 * again.deviation
    bar.close()
    stored = [[round(float(x), 6) if c else None for x, c in zip(row, crow)]
              for row, crow in zip(scores, candidate)]
    return _split(name, base, candidate, _top(scores, k, candidate), sink, window, stored)
