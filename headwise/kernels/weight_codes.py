"""A model's weights at start-up through cpu_weights.c: GGUF blocks decoded to codes
(weights.gguf_codes), codes made dense (layers.quant.QuantCodes.dense), 4-bit codes
packed for PyTorch's int4 CPU matmul (layers.int4.int4_pack).

Each function returns None where the kernel does not apply (no compiled library, a
layout or dtype it does not take), and the caller keeps its NumPy / PyTorch code. The
results are that code's bit for bit.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from headwise.kernels.cpu_kernels import DTYPES, weights_library

# GGUF block types cpu_weights.c reads, by name -> its type number there (it knows each
# type's block size, groups and lows, and checks the arrays it is given against them)
GGUF_TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}


def decode_gguf(blocks: np.ndarray, qtype: str, codes: np.ndarray, scales: np.ndarray,
                lows: np.ndarray | None) -> bool:
    """Raw blocks [n, block bytes] uint8 of GGUF type `qtype` (a key of GGUF_TYPES) into
    codes [n * inputs] int8, scales and lows [n * inputs / group] float32 (lows None for
    types without minimums); all C-contiguous, allocated by the caller. False where the
    kernel does not apply or the arrays are not the type's (nothing is written)."""
    outs = [(codes, np.int8), (scales, np.float32)] + ([] if lows is None else [(lows, np.float32)])
    if (qtype not in GGUF_TYPES or blocks.dtype != np.uint8 or blocks.ndim != 2 or not blocks.flags.c_contiguous
            or (lows is not None and lows.size != scales.size)
            or not all(a.dtype == d and a.flags.c_contiguous and a.flags.writeable for a, d in outs)):
        return False
    lib = weights_library()
    return lib is not None and lib.decode_gguf(
        blocks.ctypes.data, blocks.shape[0], blocks.shape[1], GGUF_TYPES[qtype], codes.ctypes.data, codes.size,
        scales.ctypes.data, scales.size, None if lows is None else lows.ctypes.data, torch.get_num_threads()) == 0


def dequantize(codes: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor | None, group: int,
               dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """codes [N, K] int8 times scales [N, K / group] float32 (plus lows, like scales), each
    product and sum rounded to float32, then cast to `dtype`, into `out` where given
    ([N, K] `dtype`, contiguous); None where the kernel does not apply."""
    floats = (scales,) if lows is None else (scales, lows)
    if (dtype not in DTYPES or codes.dtype != torch.int8 or codes.dim() != 2 or not codes.is_contiguous()
            or group <= 0 or codes.shape[1] % group
            or not all(t.device.type == "cpu" for t in (codes, *floats))):
        return None
    N, K = codes.shape
    if not all(t.dtype == torch.float32 and t.is_contiguous() and t.shape == (N, K // group) for t in floats):
        return None
    if out is None:
        out = torch.empty(N, K, dtype=dtype)
    elif out.shape != (N, K) or out.dtype != dtype or not out.is_contiguous():
        return None
    lib = weights_library()
    if lib is None:
        return None
    lib.dequantize(codes.data_ptr(), scales.data_ptr(), None if lows is None else lows.data_ptr(), N, K, group,
                   out.data_ptr(), DTYPES[dtype], torch.get_num_threads())
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor | None:
    """4-bit codes [N, K] int8 (0..15; N a multiple of 16, as the int4 kernel packs rows)
    in the int4 CPU matmul's packed form [N, K / 2] uint8, as
    torch.ops.aten._convert_weight_to_int4pack_for_cpu makes it from int32 codes; None
    where the kernel does not apply or lays codes out otherwise than this PyTorch build
    (int4_layout_matches)."""
    if (codes.dtype != torch.int8 or codes.dim() != 2 or not codes.is_contiguous() or codes.shape[1] % 2
            or codes.shape[0] % 16 or codes.device.type != "cpu" or not int4_layout_matches()):
        return None
    N, K = codes.shape
    out = torch.empty(N, K // 2, dtype=torch.uint8)
    weights_library().pack_int4(codes.data_ptr(), N, K, out.data_ptr(), torch.get_num_threads())
    return out


@functools.cache
def int4_layout_matches() -> bool:
    """Whether cpu_weights.c's pack_int4 writes what this PyTorch build's own packing
    writes (its layout depends on the CPU kernels it was built with), on probes of whole
    blocks of 64 rows and of last blocks of 16 and 48."""
    lib = weights_library()
    if lib is None or not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        return False
    g = torch.Generator().manual_seed(0)
    for N, K in ((80, 64), (112, 96), (128, 32)):
        probe = torch.randint(0, 16, (N, K), dtype=torch.int8, generator=g)
        ours = torch.empty(N, K // 2, dtype=torch.uint8)
        lib.pack_int4(probe.data_ptr(), N, K, ours.data_ptr(), 1)
        theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe.to(torch.int32), 1)
        if theirs.shape != ours.shape or not torch.equal(theirs, ours):
            return False
    return True
