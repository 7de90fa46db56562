"""RMSNorm and the rotary embedding through cpu_pointwise.c, where it takes the tensors.

Each function returns None where the kernel does not apply (not on the CPU, a dtype other
than float32 / bfloat16, rows it cannot address, no compiled library, inside a graph
torch.compile is tracing, or on a tensor that needs a gradient), and the layer keeps its PyTorch code. Results: float32 math
rounded once to the values' dtype, as the PyTorch code computes them (the rotary
embedding exactly so; the norm's sum of squares in another order).
"""
from __future__ import annotations

import torch

from headwise.kernels.cpu_kernels import DTYPES, pointwise_library


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, dim] with unit-stride rows (a view), or None."""
    if x.dim() == 2:
        return x if x.stride(-1) == 1 else None
    try:
        r = x.view(-1, x.shape[-1])
    except RuntimeError:
        return None
    return r if r.stride(-1) == 1 else None


def _lib(*xs: torch.Tensor):
    if torch.compiler.is_dynamo_compiling():
        return None
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        return None  # the kernels have no backward (calibration.gates trains through the model)
    if not all(x.device.type == "cpu" for x in xs):
        return None
    return pointwise_library()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(s, s / rms(s) * weight) with s = x, or s = x + residual (a new tensor, rounded to
    x's dtype); None where the kernel does not apply."""
    lib = _lib(x, weight, *(() if residual is None else (residual,)))
    if lib is None or x.dtype not in DTYPES or weight.dtype not in DTYPES or weight.stride(0) != 1:
        return None
    xr = _rows(x)
    if xr is None or weight.shape != (xr.shape[1],):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    if residual is None:
        s, rr, sr = x, None, None
    else:
        rr = _rows(residual) if residual.shape == x.shape and residual.dtype == x.dtype else None
        if rr is None:
            return None
        s = torch.empty(x.shape, dtype=x.dtype)
        sr = s.view(xr.shape)
    n, dim = xr.shape
    lib.rms_norm(xr.data_ptr(), xr.stride(0),
                 None if rr is None else rr.data_ptr(), 0 if rr is None else rr.stride(0),
                 None if sr is None else sr.data_ptr(), dim,
                 out.data_ptr(), dim, weight.data_ptr(), DTYPES[weight.dtype], n, dim, eps,
                 DTYPES[x.dtype], torch.get_num_threads())
    return s, out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, H, D] rotated by cos, sin [T, 1, D/2] (float32) into a new tensor (see
    layers.rotary.rotate); None where the kernel does not apply."""
    lib = _lib(x, cos, sin)
    if (lib is None or x.dtype not in DTYPES or x.dim() != 3 or x.stride(-1) != 1
            or cos.dtype != torch.float32 or sin.dtype != torch.float32):
        return None
    T, H, D = x.shape
    if cos.shape != (T, 1, D // 2) or sin.shape != cos.shape or D % 2:
        return None
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.rotary(x.data_ptr(), x.stride(0), x.stride(1), out.data_ptr(), H * D, D,
               cos.data_ptr(), sin.data_ptr(), cos.stride(0), T, H, D, DTYPES[x.dtype],
               torch.get_num_threads())
    return out
