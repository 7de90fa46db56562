"""Head selection by optimised gates (after DuoAttention): a gate a in [0, 1] per candidate
KV head mixes that head's full attention output with its sink + window output,

    out_h = a_h * full_h + (1 - a_h) * window_h      (for every query head of the group)

and the gates are trained by distillation: the mixed model's final hidden states at the
answer positions of retrieval prompts should equal the full model's, while an L1 penalty
pulls every gate toward 0 (window). Heads whose output the answers need resist the pull;
they are ranked by their gate, averaged over the second half of training (so heads that
reach 0 late are still ordered by how long they held out). Heads whose gate stays at 0
through the second half (with SmolLM2's defaults, most of them) would tie; they are ordered
by how hard the distillation still pulls them open: the mean of max(0, -d loss / d gate)
over the second half, the first-order loss saved per unit of opening, which the L1 pull
outweighs (GateResult.ranking). So a layout of any full fraction comes from one training.

The model is the engine's own code (models/), loaded without the inference packing, so
every op it runs has a gradient; only the gates (float32) are trained. Its weights are
float32 by default (as every shipped layout's but Qwen 1.5B's were) or bfloat16 (`headwise
calibrate --dtype bfloat16`: the matmuls run on AMX or AVX512-BF16 where the CPU has them;
times in docs/quality.md, "Gate training time"); the loss is taken in float32 either way.
Layers are recomputed in the backward pass (activation checkpointing) to bound memory.
Deterministic for a seed on one machine: fixed sample order, fixed initialisation.
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from headwise.models.causal_lm import CausalLM


@dataclass
class GateSample:
    ids: list[int]          # prompt + answer tokens
    answer_rows: list[int]  # positions whose next token is an answer token


@dataclass
class GateResult:
    gates: torch.Tensor      # [L, Hkv] final gates
    scores: torch.Tensor     # [L, Hkv] gates averaged over the second half of training
    losses: list[float]      # distillation loss (relative MSE) per step
    pressure: torch.Tensor   # [L, Hkv] mean over the second half of max(0, -d distill / d gate)

    @property
    def ranking(self) -> torch.Tensor:
        """[L, Hkv] one score per head, higher = keep full: the mean gate where it is above
        0; where it is 0, -1 + pressure / (largest such pressure), in [-1, 0], so every
        closed head ranks below every open one, by its pull toward opening."""
        closed = self.scores <= 0
        p = self.pressure * closed
        top = float(p.max())
        return torch.where(closed, -1.0 + (p / top if top > 0 else p), self.scores)


def window_mask(T: int, sink: int, window: int) -> torch.Tensor:
    """[T, T] bool: query i sees key j when j <= i and (j < sink or j > i - window), the
    tokens a window head keeps when it attends at position i."""
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    return (j <= i) & ((j < sink) | (j > i - window))


class GatedAttention(nn.Module):
    """Stands in for a layer's HeadSplitAttention while gates train. Candidate heads mix
    full and sink + window attention by their gate; a fixed window head (a sliding-window
    layer of Gemma 3) attends through its own window only."""

    def __init__(self, inner, gates: nn.Parameter, layer: int, candidate: list[bool],
                 windows: list[tuple[int, int] | None], sink: int, window: int) -> None:
        super().__init__()
        self.group, self.scale = inner.group, inner.scale
        self.gates, self.layer = gates, layer
        self.candidate = torch.tensor(candidate)
        self.windows, self.sink, self.window = windows, sink, window
        self.masks: dict[tuple[int, int, int], torch.Tensor] = {}

    def _mask(self, T: int, sink: int, window: int) -> torch.Tensor:
        key = (T, sink, window)
        if key not in self.masks:
            if self.masks and next(iter(self.masks))[0] != T:
                self.masks = {}  # one prompt length at a time
            self.masks[key] = window_mask(T, sink, window)
        return self.masks[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D]. Attention runs on [1, Hq, T, D]:
        # PyTorch's fused CPU kernel (forward and backward) takes only 4-D inputs; 3-D ones
        # fall back to the math path, which keeps [Hq, T, T] scores per call (3-5x slower).
        T, Hq, D = q.shape
        g = self.group
        qq = q.transpose(0, 1)[None]                                   # [1, Hq, T, D]
        kk = k.repeat_interleave(g, dim=1).transpose(0, 1)[None]
        vv = v.repeat_interleave(g, dim=1).transpose(0, 1)[None]
        if all(w is not None for w in self.windows) and len(set(self.windows)) == 1:  # a sliding layer
            out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=self._mask(T, *self.windows[0]),
                                                 scale=self.scale)
            return out[0].transpose(0, 1)
        full = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=self.scale)[0]
        # Queries before sink + window see all their keys either way: the window output
        # differs from the full one only after r0.
        r0 = min(T, self.sink + self.window)
        win = F.scaled_dot_product_attention(qq[:, :, r0:], kk, vv, scale=self.scale,
                                             attn_mask=self._mask(T, self.sink, self.window)[r0:])[0]
        a = torch.where(self.candidate, self.gates[self.layer].clamp(0, 1), 1.0).to(q.dtype)  # [Hkv]
        tail = a.repeat_interleave(g)[:, None, None] * (full[:, r0:] - win) + win
        out = torch.cat((full[:, :r0], tail), dim=1)
        for h, w in enumerate(self.windows):  # heads the model itself windows
            if w is not None:
                s = slice(h * g, (h + 1) * g)
                out[s] = F.scaled_dot_product_attention(qq[:, s], kk[:, s], vv[:, s], attn_mask=self._mask(T, *w),
                                                        scale=self.scale)[0]
        return out.transpose(0, 1)


@contextmanager
def gated(model: CausalLM, gates: torch.Tensor, candidate: torch.Tensor,
          fixed_windows: dict[int, tuple[int, int]], sink: int, window: int):
    """The model with every layer's attention a GatedAttention reading `gates` [L, Hkv]
    (candidate heads mix, the others are full or the model's own window); restored after."""
    layers = model.model.layers
    inner = [layer.self_attn.attn for layer in layers]
    H = candidate.shape[1]
    for l, layer in enumerate(layers):
        wins = [fixed_windows.get(l) if not candidate[l, h] else None for h in range(H)]
        layer.self_attn.attn = GatedAttention(inner[l], gates, l, candidate[l].tolist(), wins, sink, window)
    try:
        yield model
    finally:
        for layer, attn in zip(layers, inner):
            layer.self_attn.attn = attn


def hidden_states(model: CausalLM, ids: torch.Tensor, rows: torch.Tensor, train: bool) -> torch.Tensor:
    """Final-norm hidden states [len(rows), hidden] at `rows`; each layer checkpointed when
    training."""
    m = model.model
    x = m.embed_tokens(ids)
    if m.embed_scale is not None:
        x = x * torch.tensor(m.embed_scale, dtype=x.dtype)
    tables = model.rope_tables(torch.arange(len(ids)))
    for layer, theta in zip(m.layers, m.layer_theta):
        x = checkpoint(layer, x, tables[theta], use_reentrant=False) if train else layer(x, tables[theta])
    return m.norm(x[rows])


def train_gates(model: CausalLM, samples: list[GateSample], candidate: torch.Tensor,
                fixed_windows: dict[int, tuple[int, int]], sink: int, window: int, steps: int,
                lr: float = 0.05, l1: float = 0.05, seed: int = 0, init: float = 0.5,
                progress=None) -> GateResult:
    """Train one gate per candidate KV head of `model` (float32 or bfloat16, unpacked:
    loaded by weights.loader.load_model) on `samples`; candidate [L, Hkv] bool; fixed_windows:
    layer -> (sink, window) for layers the model itself windows (their heads are not
    candidates). Gates start at `init` (halfway: each moves up if the answers need the head
    more than the pull toward window). The model's attention modules are restored
    afterwards."""
    if not samples:
        raise ValueError("gate training needs at least one sample")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    torch.manual_seed(seed)
    L, H = candidate.shape
    for p in model.parameters():
        p.requires_grad_(False)
    gates = nn.Parameter(torch.full((L, H), float(init)))
    with gated(model, gates, candidate, fixed_windows, sink, window):
        data = [(torch.tensor(s.ids), torch.tensor(s.answer_rows)) for s in samples]
        with torch.no_grad():  # the full model's states: every gate open
            gates.fill_(1.0)
            targets = [hidden_states(model, ids, rows, False).float() for ids, rows in data]
            gates.fill_(float(init))
        order = list(range(len(data)))
        random.Random(seed).shuffle(order)
        opt = torch.optim.Adam([gates], lr=lr)
        n_cand = max(1, int(candidate.sum()))
        losses, kept, pulls = [], [], []
        for step in range(steps):
            i = order[step % len(order)]
            ids, rows = data[i]
            h = hidden_states(model, ids, rows, True).float()
            t = targets[i]
            distill = (h - t).pow(2).mean() / t.pow(2).mean()
            penalty = (gates.clamp(0, 1) * candidate).sum() / n_cand
            # The two gradients apart: the distillation's is the heads' pull toward opening.
            (g_distill,) = torch.autograd.grad(distill, gates)
            (g_penalty,) = torch.autograd.grad(l1 * penalty, gates)
            gates.grad = g_distill + g_penalty
            opt.step()
            with torch.no_grad():
                gates.clamp_(0, 1)
            losses.append(float(distill.detach()))
            if step >= steps // 2:
                kept.append(gates.detach().clone())
                pulls.append((-g_distill).clamp(min=0) * candidate)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{float(distill.detach()):.4f}", mean_gate=f"{float(penalty.detach()):.2f}")
    final = gates.detach().clone() * candidate
    return GateResult(final, torch.stack(kept).mean(0) * candidate, losses, torch.stack(pulls).mean(0))
