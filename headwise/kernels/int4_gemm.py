"""Matmuls of any row count over a weight kept only as 4-bit codes (kernels/cpu_gemm.c),
in the packed form of PyTorch's int4 CPU matmul (layers.linear.int4_pack): codes
[N, K / 2] uint8 and scales with offsets [K / 32, N, 2] bfloat16.

PyTorch's own int4 kernel is the faster one at a few rows and loses to the packed
bfloat16 weight from about 16 (layers/linear.py). This one dequantizes each weight once
per call into a bfloat16 tile and multiplies every row against it with AVX512-BF16 dot
products: within 2-15% of the packed weight's time from 8 rows to prefill chunks, from a
third of its bytes (benchmarks/bench_int4_gemm.py, docs/benchmarks.md). The engine calls
it (layers.linear.int4_any_rows) for calls of more than 8 rows in a model kept without
dense copies of its 4-bit weights (dense_weights=False).
"""
from __future__ import annotations

import torch

from headwise.kernels.cpu_kernels import gemm_library
from headwise.kernels.weight_codes import int4_layout_matches

BLOCK_ROWS = 64  # output rows per block of the packed layout: N must be a multiple


def int4_gemm(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] bfloat16 (unit inner stride) times the 4-bit weight (codes [N, K / 2]
    uint8, sz [K / 32, N, 2] bfloat16: w = (code - 8) * scale + offset, rounded to
    bfloat16) transposed -> [M, N] bfloat16, accumulated in float32. None where the kernel
    does not apply: no compiled library or AVX512-BF16, another dtype or device, N not a
    multiple of 64, a PyTorch build whose packed layout is not the one read here, inside
    a torch.compile trace."""
    if (torch.compiler.is_dynamo_compiling() or x.device.type != "cpu" or x.dtype != torch.bfloat16
            or x.dim() != 2 or x.shape[0] == 0 or x.stride(-1) != 1):
        return None
    M, K = x.shape
    N = codes.shape[0]
    if (codes.dtype != torch.uint8 or codes.shape != (N, K // 2) or not codes.is_contiguous() or K % 32
            or N % BLOCK_ROWS or sz.dtype != torch.bfloat16 or sz.shape != (K // 32, N, 2)
            or not sz.is_contiguous() or not int4_layout_matches()):
        return None
    lib = gemm_library()
    if lib is None:
        return None
    out = torch.empty(M, N, dtype=torch.bfloat16)
    rc = lib.int4_gemm(x.data_ptr(), x.stride(0), M, K, codes.data_ptr(), sz.data_ptr(), N, out.data_ptr(), N,
                       torch.get_num_threads())
    if rc == -2:
        raise MemoryError("int4 gemm: out of memory")
    return None if rc else out
