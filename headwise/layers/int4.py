"""A weight's 4-bit copy: GGUF Q4_0/Q4_1/Q4_K codes (or a float weight found to be exactly
that) packed for PyTorch's int4 CPU matmul, and the matmuls that read it.

Decode at small batch reads every weight once per step, so it is bound by memory
bandwidth; the 4-bit copy is a quarter of a bfloat16 weight's bytes. PyTorch's int4
kernel serves calls of up to INT4_MAX_ROWS rows (INT4_MAX_ROWS_AMX where codes_gemm has
AMX; it dequantizes again for every 4 rows, so it loses to the packed bfloat16 weight from
about 16); kernels.codes_gemm serves larger ones (in a model kept without dense copies;
5-8 rows with AMX in either). Used by layers.linear (Linear, FusedInt4).
"""
from __future__ import annotations

import torch
from torch import nn

from headwise.kernels import weight_codes
from headwise.kernels.codes_gemm import amx_multiplies, int4_gemm
from headwise.kernels.int8_matmul import AFFINE_GROUP, exact_affine
from headwise.layers.quant import QuantCodes

INT4_GROUP = AFFINE_GROUP  # inputs per scale/offset group (GGUF Q4_0/Q4_1 blocks, Q4_K sub-blocks)
INT4_MAX_ROWS = 8   # calls with at most this many rows use PyTorch's int4 kernel (decode)
# ... at most this many where kernels.codes_gemm multiplies with AMX: its int4_gemm takes
# 0.6-0.7x the time of PyTorch's kernel at 8 rows (bench_codes_gemm.py: Qwen2.5-Coder-1.5B
# 78 vs 126 ms a pass, SmolLM2 9.3 vs 13.5), 1.1-1.3x at 4; with dot products alone it is
# 1.2x slower at 8.
INT4_MAX_ROWS_AMX = 4
# Activation dtypes the 4-bit copy is kept for. With float32 activations PyTorch's int4
# CPU kernel is about 10x slower than the packed float32 weight (bench_linear.py --dtype
# float32: 288 vs 22 ms per pass over SmolLM2's projections at one row, 2026-12-01).
INT4_DTYPES = (torch.bfloat16,)


def exact_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """w [N, K] float32 as codes [N, K] (int32, 0..15), scale and low [N, K/32] with
    w = low + code * scale in every group of 32 inputs (to float32 rounding), if w is that
    and the int4 kernel takes its shape, else None (kernels.int8_matmul.exact_affine: GGUF
    Q4_1, Q4_0, Q4_K)."""
    if w.dim() != 2 or w.shape[0] % 16 or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None  # the int4 CPU kernel packs output rows by 16
    return exact_affine(w, 16)


def int4_codes(quant: QuantCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A file's codes in exact_int4's form, or None where they are not 4-bit or the int4
    kernel is missing."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    return quant.int4()


def int4_pack(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exact_int4's or QuantCodes.int4's result (codes int32 or int8, 0..15) in the int4 CPU
    kernel's form: (codes [N, K/2] uint8, scales and offsets [K/32, N, 2]); the kernel
    computes w = (code - 8) * scale + offset. int8 codes are packed by the C kernel where
    it lays them out as PyTorch does (kernels.weight_codes.pack_int4: one pass, no int32 copy)."""
    sz = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
    packed = weight_codes.pack_int4(codes)
    if packed is None:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    return packed, sz


def int4_cast(int4: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A 4-bit copy's scales in the activation dtype, or None for a dtype the int4 kernel
    is slow in (INT4_DTYPES): the layer then runs its packed weight."""
    return (int4[0], int4[1].to(dtype)) if dtype in INT4_DTYPES else None


def torch_int4_rows() -> int:
    """Rows up to which PyTorch's int4 kernel serves a call over a 4-bit copy (above,
    kernels.codes_gemm where it takes the call)."""
    return INT4_MAX_ROWS_AMX if amx_multiplies() else INT4_MAX_ROWS


def decode_sized(x: torch.Tensor) -> bool:
    """A call small enough for the 4-bit weight (decode)."""
    return x.dim() == 2 and x.shape[0] <= INT4_MAX_ROWS


def int4_matmul(x: torch.Tensor, int4: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [M, K] -> [M, N] by PyTorch's int4 kernel, for any M: decode-sized calls of every
    4-bit copy, and the calls kernels.codes_gemm declines in a model with no dense copy."""
    codes, sz = int4
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), codes, INT4_GROUP, sz)


def int4_any_rows(x: torch.Tensor, int4: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [M, K] -> [M, N] over a 4-bit copy, whatever M: PyTorch's int4 kernel for
    decode-sized calls (the faster one there: up to INT4_MAX_ROWS rows, INT4_MAX_ROWS_AMX
    where codes_gemm has AMX), kernels.codes_gemm above (2.3-2.5x faster than PyTorch's
    from 16 rows: it dequantizes each weight block once per call, not per 4 rows),
    PyTorch's kernel where that declines (no AVX512-BF16, a torch.compile trace)."""
    if x.shape[0] > torch_int4_rows():
        y = int4_gemm(x, *int4)
        if y is not None:
            return y
    return int4_matmul(x, int4)


@torch.library.custom_op("headwise::int4_any_rows", mutates_args=())
def int4_any_rows_op(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """int4_any_rows as an opaque op of a compiled graph (engine.decode_capture), for the
    graph of steps above torch_int4_rows() (5-8 tokens with AMX): traced, the graph would
    hold PyTorch's int4 kernel, which Python's ctypes call to codes_gemm cannot join. An
    op costs a Python call per matmul (batch-1 decode of SmolLM2 5% slower when every
    graph used it), so smaller steps keep the traced kernel."""
    return int4_any_rows(x, (codes, sz))


@int4_any_rows_op.register_fake
def _(x, codes, sz):
    return x.new_empty(x.shape[0], codes.shape[0])


class Int4Copy:
    """The 4-bit copy a module keeps, as buffers (so a compiled graph takes them as inputs):
    `int4` is (codes packed by the int4 kernel [N, K/2] uint8, scales and offsets
    [K/32, N, 2]) or None."""

    @staticmethod
    def init(module: nn.Module) -> None:
        module.register_buffer("int4_codes", None, persistent=False)
        module.register_buffer("int4_scales", None, persistent=False)

    @property
    def int4(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.int4_codes is None else (self.int4_codes, self.int4_scales)

    @int4.setter
    def int4(self, value: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.int4_codes, self.int4_scales = (None, None) if value is None else value

    def int4_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] through the 4-bit copy (plus the module's bias) -> [..., N]."""
        x2 = x.reshape(-1, x.shape[-1])
        # Traced, the comparison guards the graph on the row count: steps of 2-4 tokens
        # and of 5-8 get graphs of their own (decode_capture.warmup_tokens).
        if torch.compiler.is_dynamo_compiling() and x2.shape[0] > torch_int4_rows():
            y = int4_any_rows_op(x2, *self.int4)
        else:
            y = int4_any_rows(x2, self.int4)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias
