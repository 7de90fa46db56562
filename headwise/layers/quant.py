"""A quantized weight as its file stores it: integer codes with a float32 scale (and, for
formats with a minimum, a float32 low) per group of inputs, w = scale * code (+ low).

The GGUF loader (weights.gguf_codes) reads these straight from a file's blocks, so the
decode copies of layers.linear and layers.embedding are taken from them instead of being
searched for in the dense float32 weight (kernels.int8_matmul.exact_affine: 90 s of
Qwen2.5-Coder-1.5B's start on 2 cores). The dense weight is computed from them with the
same float32 operations, in the same order, as gguf's dequantizers, so it is the same
weight bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from headwise.kernels.weight_codes import dequantize

INT4_LEVELS = 16   # a 4-bit copy (layers.linear): codes 0..15 with a low per group
INT4_GROUP = 32    # inputs per scale of the int4 CPU kernel
INT8_GROUPS = (32, 16)  # inputs per scale the int8 kernel reads (kernels.int8_matmul)
DENSE_ROWS = 4096  # rows dense() computes at a time


@dataclass
class QuantCodes:
    """codes [N, K] int8; scales [N, K / group] float32; lows like scales or None.
    `levels`: how many codes the format has (16: 4-bit, 32: 5-bit, 64: 6-bit, 256: 8-bit).
    With lows, codes run 0..levels - 1 (Q4_1, Q4_K, Q5_1, Q5_K); without, they are signed
    and centred (Q4_0: -8..7, Q5_0, Q6_K, Q8_0)."""
    codes: torch.Tensor
    scales: torch.Tensor
    lows: torch.Tensor | None
    group: int
    levels: int

    def __post_init__(self) -> None:
        N, K = self.codes.shape
        if (self.codes.dtype != torch.int8 or K % self.group or self.scales.shape != (N, K // self.group)
                or self.scales.dtype != torch.float32
                or (self.lows is not None and (self.lows.shape != self.scales.shape
                                               or self.lows.dtype != torch.float32))):
            raise ValueError(f"quantized weight: codes {tuple(self.codes.shape)} {self.codes.dtype}, "
                             f"scales {tuple(self.scales.shape)} {self.scales.dtype}, group {self.group}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dense(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] in `dtype`: scale * code, then + low, in float32 with one rounding each
        (gguf's order), then cast: one pass of the C kernel (kernels.weight_codes), else
        dense_torch. `out`: written there (contiguous, [N, K] in `dtype`) instead of new
        memory."""
        if out is not None and (out.shape != self.codes.shape or out.dtype != dtype or not out.is_contiguous()):
            raise ValueError(f"dense(): out must be {tuple(self.codes.shape)} {dtype}, contiguous; "
                             f"got {tuple(out.shape)} {out.dtype}")
        made = dequantize(self.codes, self.scales, self.lows, self.group, dtype, out)
        if made is None:
            made = self.dense_torch(dtype)
            if out is not None:
                made = out.copy_(made)
        return made

    def dense_torch(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """dense() in PyTorch's ops: four passes over the weight (the C kernel makes one), in
        runs of rows, so a 16-bit weight never has a whole float32 copy beside it (a
        151,936-token vocabulary projection: 0.9 GB)."""
        N, K = self.codes.shape
        out = torch.empty(N, K, dtype=dtype)
        for r in range(0, N, DENSE_ROWS):
            w = self.codes[r:r + DENSE_ROWS].view(-1, K // self.group, self.group).float()
            w *= self.scales[r:r + DENSE_ROWS].unsqueeze(-1)
            if self.lows is not None:
                w += self.lows[r:r + DENSE_ROWS].unsqueeze(-1)
            out[r:r + DENSE_ROWS] = w.view(-1, K)
        return out

    def int4(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes [N, K] int8 0..15, scales, lows [N, K/32]) with w = low + code * scale,
        as layers.int4.int4_pack takes them, or None: more than 16 levels, groups other
        than 32, or rows the int4 kernel cannot pack (it packs them by 16)."""
        if self.levels > INT4_LEVELS or self.group != INT4_GROUP or self.codes.shape[0] % 16:
            return None
        if self.lows is not None:
            return self.codes, self.scales, self.lows
        # signed codes -8..7: code + 8 with low -8 * scale (exact: a power of two)
        return self.codes + 8, self.scales, self.scales * -8.0

    def int8(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(codes, scales, lows or None) as kernels.int8_matmul reads them, or None where
        its groups are not ones the kernel reads."""
        if self.group not in INT8_GROUPS:
            return None
        return self.codes, self.scales, self.lows

    def take_rows(self, index: torch.Tensor) -> QuantCodes:
        """Output rows `index` (a head permutation of q/k/v)."""
        return QuantCodes(self.codes.index_select(0, index), self.scales.index_select(0, index),
                          None if self.lows is None else self.lows.index_select(0, index),
                          self.group, self.levels)

    def take_columns(self, index: torch.Tensor) -> QuantCodes | None:
        """Input columns `index`, or None where they do not move whole groups (the scales
        cannot follow): a head permutation of o_proj, in runs of head_dim columns."""
        g = self.group
        starts = index.view(-1, g)[:, 0] if index.numel() % g == 0 else None
        if starts is None or (starts % g).any() or not torch.equal(
                index.view(-1, g), starts[:, None] + torch.arange(g)):
            return None
        groups = starts // g
        return QuantCodes(self.codes.index_select(1, index), self.scales.index_select(1, groups),
                          None if self.lows is None else self.lows.index_select(1, groups), g, self.levels)

    @staticmethod
    def cat_rows(parts: list[QuantCodes]) -> QuantCodes | None:
        """Several weights of the same inputs stacked by rows (q/k/v, gate/up), or None
        where their formats differ (group, lows or not)."""
        first = parts[0]
        if any(p.group != first.group or (p.lows is None) != (first.lows is None) for p in parts):
            return None
        return QuantCodes(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          None if first.lows is None else torch.cat([p.lows for p in parts]),
                          first.group, max(p.levels for p in parts))
