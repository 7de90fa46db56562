"""A KV cache tensor in its storage format, and the one quantizer every path uses.

Plain classes store K or V as they are (possibly in another float dtype than the
model computes in). Quantized classes (int8; fp8_e4m3 on CUDA) store per token and head
a vector q [D] and one symmetric scale s, x ~ q * s with s = max|x| / QMAX, so a token
is quantized once, when it is written, on its own (no statistics over other tokens).

Attention always sees what the cache gives back: the layer encodes a step's K/V once,
writes that form and attends its decoded form, so a prompt computed in chunks, in one
pass, or partly read from the prefix cache gives the same numbers. Nothing dequantizes
the whole cache: decode attends quantized K/V in their stored form
(torch_attention.scaled_attention), other reads decode only what they attend.
"""
from __future__ import annotations

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize(x: torch.Tensor, dtype: torch.dtype, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] in `dtype`, scale [...] in `scale_dtype`). The scale is
    rounded to its dtype before dividing, so q * scale is the value every read returns."""
    xf = x.float()
    qmax = QMAX[dtype]
    s = (xf.abs().amax(-1) / qmax).clamp(min=torch.finfo(scale_dtype).tiny).to(scale_dtype)
    y = (xf / s.float()[..., None]).clamp(-qmax, qmax)
    return (y.round() if dtype == torch.int8 else y).to(dtype), s


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [..., D], scale [...]) -> [..., D] in `dtype` (the compute dtype)."""
    if q.dtype == torch.int8 and s.dtype == dtype:
        return torch.mul(q, s[..., None])  # one kernel: int8 * bf16/f32 promotes to dtype
    return q.to(dtype) * s[..., None]


def take(form: tuple[torch.Tensor, torch.Tensor | None], fn) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply one indexing `fn` (over leading dims) to a stored form's values and scales."""
    q, s = form
    return fn(q), None if s is None else fn(s)


class KVTensor:
    """K or V of one head class (or one window group): data [..., D] in the storage dtype
    and, quantized, scale [...] (the same leading shape). Indexes address leading dims and
    apply to both. `dtype` is the compute dtype reads return."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.data = data
        self.scale = scale
        self.dtype = dtype

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    @property
    def format(self) -> tuple[torch.dtype, torch.dtype | None]:
        """(value dtype, scale dtype or None): caches alike encode alike."""
        return self.data.dtype, None if self.scale is None else self.scale.dtype

    @property
    def plain(self) -> bool:
        """Stored exactly as computed: reads are views, no conversion."""
        return self.scale is None and self.data.dtype == self.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __getitem__(self, idx) -> "KVTensor":
        return KVTensor(self.data[idx], None if self.scale is None else self.scale[idx], self.dtype)

    @staticmethod
    def cat(parts: list["KVTensor"], dim: int) -> "KVTensor":
        """Concatenate along a leading dim (values and scales alike)."""
        scale = None if parts[0].scale is None else torch.cat([p.scale for p in parts], dim)
        return KVTensor(torch.cat([p.data for p in parts], dim), scale, parts[0].dtype)

    # ---- format ------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [..., D] (compute dtype) -> its stored form (values, scales or None)."""
        if self.scale is None:
            return x.to(self.data.dtype), None
        return quantize(x, self.data.dtype, self.scale.dtype)

    def encode_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple, tuple]:
        """K and V [..., D] -> their stored forms, quantized in one call for both."""
        if self.scale is None:
            return self.encode(k), self.encode(v)
        q, s = quantize(torch.stack((k, v)), self.data.dtype, self.scale.dtype)
        return (q[0], s[0]), (q[1], s[1])

    def decode(self, q: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        """A stored form -> values in the compute dtype (no copy when already them)."""
        if s is None:
            return q.to(self.dtype)
        return dequantize(q, s, self.dtype)

    # ---- reads and writes ----------------------------------------------------------
    def put(self, idx, q: torch.Tensor, s: torch.Tensor | None) -> None:
        """Write an encoded form (see encode) at `idx` (leading dims)."""
        self.data[idx] = q
        if self.scale is not None:
            self.scale[idx] = s

    def load(self, idx=...) -> torch.Tensor:
        """Values at `idx` in the compute dtype: a view when stored as such, else a
        dequantized copy of just those."""
        s = None if self.scale is None else self.scale[idx]
        return self.decode(self.data[idx], s)
