"""Rotary position embedding (half-split layout, as HF Llama/Qwen use)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from headwise.kernels import pointwise


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [P, D/2]
        # Plain attributes, not buffers: the tables stay float32 when the model is cast.
        self.cos = freqs.cos()  # [P, D/2]
        self.sin = freqs.sin()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, D/2] of positions [T]; the same for every layer of a step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(tables: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
        # q: [T, Hq, D], k: [T, Hkv, D] rotated by tables (see tables())
        cos, sin = tables
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.apply(self.tables(positions), q, k)

    def back_tables(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, D/2] that turn x [T, H, D], rotated to positions p, to
        positions p - delta[T] (see rotate)."""
        return self.cos[delta].unsqueeze(1), -self.sin[delta].unsqueeze(1)  # a rotation by -delta


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D], cos and sin [T, 1, D/2] float32; computed in float32, rounded once
    done = pointwise.rotate(x, cos, sin)  # the C kernel, where it applies
    if done is not None:
        return done
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
