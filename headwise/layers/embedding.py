"""Token embedding that can look rows up from int8 codes instead of a dense weight.

Both default models embed tokens with a GGUF Q8_0 table (int8 codes, a scale per 32
inputs) that their vocabulary projection shares (tied). The projection keeps those codes
for decode (layers.linear), so a dense bfloat16 copy kept for lookups only is the largest
tensor in memory (Gemma 3 270M: 262,144 x 640, 320 MiB). A row looked up from the codes,
bf16(scale * code), is exactly the row the dense bfloat16 weight held (the dense weight
is bf16 of the same float32 product), so the dense weight can go. (A table with a
minimum per group, Q5_1 or Q5_K, is reproduced to float32 rounding before that cast.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from headwise.kernels.int8_matmul import int8_copy
from headwise.layers.quant import QuantCodes


class Embedding(nn.Module):
    """nn.Embedding's lookup and parameter name (checkpoints load as is); after
    compact() a weight that is exactly int8 is read from its codes."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        if not self.weight.is_meta:  # on meta (loading) its reference impl imports torch._dynamo: 1.4 s
            nn.init.normal_(self.weight)  # nn.Embedding's initialisation (random-weight tests)
        # codes [V, dim] int8, scales [V, dim / G] float32 (G = 32 or 16 inputs per scale)
        # and lows like scales or None: a row is codes * scales (+ lows), as int8_matmul reads
        self.register_buffer("int8_codes", None, persistent=False)
        self.register_buffer("int8_scales", None, persistent=False)
        self.register_buffer("int8_lows", None, persistent=False)
        self.dtype = self.weight.dtype  # of the rows a lookup returns
        self.quant: QuantCodes | None = None  # the file's codes (layers.quant), where read

    def find_int8(self, tied=None) -> bool:
        """Keep the weight as int8 codes if it is exactly that: a tied projection's int8
        copy (shared, not copied), the file's codes (`quant`), or int8_copy of the weight
        itself. Call while the weight is float32, before the model is cast."""
        quant = self.quant  # kept: materialize() makes the dense weight from it, then drops it
        if self.weight is None and quant is None:
            return False
        if tied is not None and tied.int8_codes is not None:
            found = tied.int8_codes, tied.int8_scales, tied.int8_lows
        elif quant is not None:
            found = quant.int8()
            if found is None:
                return False
        else:
            found = int8_copy(self.weight.detach())
            if found is None:
                return False
        self.int8_codes, self.int8_scales, self.int8_lows = found
        return True

    def materialize(self, dtype: torch.dtype) -> None:
        """The dense weight in `dtype` from the file's codes where loading left it out
        (weights.loader.load_weights' lazy mode), then the codes are dropped."""
        if self.weight is None and self.quant is not None:
            self.weight = nn.Parameter(self.quant.dense(dtype), requires_grad=False)
        self.quant = None

    def compact(self, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...]) -> bool:
        """Drop the dense weight where there are codes and rows are looked up in one of
        `dtypes` (where the tied projection keeps its copy: see layers.linear.INT8_DTYPES);
        else drop the codes, making the dense weight from the file's codes if a lazy load
        left it out. After the model's cast; the scales must be float32 again. True where
        lookups read the codes."""
        self.dtype = dtype
        codes = self.int8_codes
        if codes is None or dtype not in dtypes or codes.device.type != "cpu":
            self.materialize(dtype)
            if self.weight is not None:
                self.int8_codes = self.int8_scales = self.int8_lows = None
            return self.weight is None
        if self.int8_scales.dtype != torch.float32:
            raise ValueError("int8 scales must stay float32 (exact) through the model's cast")
        self.weight, self.quant = None, None
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [T] -> [T, dim]
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        codes, scales = self.int8_codes[ids], self.int8_scales[ids]  # [T, dim], [T, dim / G]
        rows = codes.view(*scales.shape, -1).float() * scales.unsqueeze(-1)
        if self.int8_lows is not None:
            rows += self.int8_lows[ids].unsqueeze(-1)
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8={self.weight is None}"
