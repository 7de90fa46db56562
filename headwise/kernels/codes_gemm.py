"""Matmuls of any row count over a weight kept only as codes (kernels/cpu_gemm.c), with no
dense copy beside them:
- int4_gemm: 4-bit codes in the packed form of PyTorch's int4 CPU matmul
  (layers.int4.int4_pack): codes [N, K / 2] uint8 and scales with offsets
  [K / 32, N, 2] bfloat16;
- int8_gemm: int8 codes [N, K] with a float32 scale (and minimum, or none) per 16 or 32
  inputs, as kernels.int8_matmul reads them (GGUF Q8_0, Q6_K, Q5_0, Q5_K ...).

PyTorch's own int4 kernel is the faster one at a few rows and loses to the packed
bfloat16 weight from about 16 (layers/linear.py); kernels.int8_matmul takes up to 4 rows.
These dequantize each weight once per call into a bfloat16 tile and multiply every row
against it with AVX512-BF16 dot products, or AMX tiles where the CPU has them: int4_gemm
within 2-15% of the packed weight's time from 8 rows to prefill chunks, from a third of
its bytes, on a CPU without AMX; with AMX 0.6-0.9x its time from 4 to 64 rows and
0.6-1.3x at 256-1024 (benchmarks/bench_codes_gemm.py, docs/benchmarks.md). The
engine calls them (layers.linear) for the larger calls of a model kept without dense
copies (the default of a bfloat16 CPU engine).

int4_gemm_glu and int8_gemm_glu compute an MLP's act(gate(x)) * up(x) in the same pass,
from a fused gate/up 4-bit weight or two int8 ones, rounding once: unfused, the [M, 2 I]
product and the activation's and the product's passes over it were a fifth of a codes-only
prefill's matmul time (SmolLM2, 8K: 0.27 of 1.57 s); oneDNN fuses the same into the packed
dense weight's matmul.
"""
from __future__ import annotations

import functools

import torch

from headwise.kernels.cpu_kernels import gemm_library
from headwise.kernels.weight_codes import int4_layout_matches

BLOCK_ROWS = 64  # output rows per block of the kernels' tiles: N must be a multiple
INT8_GROUPS = (16, 32)  # inputs per scale int8_gemm reads
GLU_ACTS = {"silu": 1, "gelu_tanh": 2}  # activations the gated products apply (cpu_gemm.c's ACT_*)


def _takes(x: torch.Tensor) -> bool:
    """Activations the kernels take: [M, K] bfloat16 on the CPU, unit inner stride, M > 0,
    outside a torch.compile trace."""
    return (not torch.compiler.is_dynamo_compiling() and x.device.type == "cpu" and x.dtype == torch.bfloat16
            and x.dim() == 2 and x.shape[0] > 0 and x.stride(-1) == 1)


def _int4_form(codes: torch.Tensor, sz: torch.Tensor, K: int, rows_of: int) -> bool:
    """codes [N, K / 2] uint8 and sz [K / 32, N, 2] bfloat16, contiguous, in the layout of
    this PyTorch's int4 kernel, N a multiple of rows_of."""
    N = codes.shape[0]
    return (codes.dtype == torch.uint8 and codes.shape == (N, K // 2) and codes.is_contiguous() and K % 32 == 0
            and N % rows_of == 0 and sz.dtype == torch.bfloat16 and sz.shape == (K // 32, N, 2)
            and sz.is_contiguous() and int4_layout_matches())


def _int8_form(codes: torch.Tensor, scales: torch.Tensor, K: int) -> bool:
    """codes [N, K], N a multiple of 64, with a scale per 16 or 32 inputs."""
    return (codes.shape[1] == K and K % 32 == 0 and codes.shape[0] % BLOCK_ROWS == 0
            and K % scales.shape[1] == 0 and K // scales.shape[1] in INT8_GROUPS)


def _run(name: str, out: torch.Tensor, *args) -> torch.Tensor | None:
    """The library's `name`(*args, threads): out, or None where the kernel declined (or
    no library was built)."""
    lib = gemm_library()
    if lib is None:
        return None
    rc = getattr(lib, name)(*args, torch.get_num_threads())
    if rc == -2:
        raise MemoryError(f"{name}: out of memory")
    return None if rc else out


def int4_gemm(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] bfloat16 (unit inner stride) times the 4-bit weight (codes [N, K / 2]
    uint8, sz [K / 32, N, 2] bfloat16: w = (code - 8) * scale + offset, rounded to
    bfloat16) transposed -> [M, N] bfloat16, accumulated in float32. None where the kernel
    does not apply: no compiled library or AVX512-BF16, another dtype or device, N not a
    multiple of 64, a PyTorch build whose packed layout is not the one read here, inside
    a torch.compile trace."""
    if not _takes(x) or not _int4_form(codes, sz, x.shape[1], BLOCK_ROWS):
        return None
    M, K = x.shape
    N = codes.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16)
    return _run("int4_gemm", out, x.data_ptr(), x.stride(0), M, K, codes.data_ptr(), sz.data_ptr(), N,
                out.data_ptr(), N)


@functools.cache
def available() -> bool:
    """Whether the matmuls over codes run on this machine (a built library with
    AVX512-BF16, PyTorch's int4 layout the one read here): a model can then keep its
    quantized weights as codes alone."""
    return int4_gemm(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(BLOCK_ROWS, 16, dtype=torch.uint8),
                     torch.zeros(1, BLOCK_ROWS, 2, dtype=torch.bfloat16)) is not None


_AMX: list[bool] = []  # gemm_amx's last answer, so that traced code asks no library


def gemm_amx(on: bool | None = None) -> bool:
    """Whether int4_gemm and int8_gemm multiply with AMX tiles (on a CPU that has them,
    once Linux grants the tile state); on=False turns AMX off for this process, True back
    on where it can be (benchmarks and tests compare the two)."""
    lib = gemm_library()
    _AMX[:] = [lib is not None and bool(lib.gemm_amx(-1 if on is None else int(on)))]
    return _AMX[0]


def amx_multiplies() -> bool:
    """gemm_amx()'s answer without calling the library after the first time (a
    torch.compile trace reads it: a library call there would break the graph)."""
    return _AMX[0] if _AMX else gemm_amx()


def int8_gemm_takes(codes: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor | None) -> bool:
    """Whether int8_gemm reads this weight (as kernels.int8_matmul.check_int8_weight
    checks it) on this machine: N a multiple of 64, K of 32, and a built kernel."""
    N, K = codes.shape
    return (N > 0 and _int8_form(codes, scales, K) and codes.device.type == "cpu"
            and int8_gemm(torch.zeros(1, K, dtype=torch.bfloat16), codes[:BLOCK_ROWS], scales[:BLOCK_ROWS],
                          None if lows is None else lows[:BLOCK_ROWS]) is not None)


def int8_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              lows: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] bfloat16 (unit inner stride) times the int8 weight (codes [N, K] int8,
    scales [N, K / G] float32 with G = 16 or 32, lows like scales or None, all contiguous:
    w = code * scale (+ low) in float32, rounded to bfloat16, as layers.quant's dense
    weight) transposed -> [M, N] bfloat16, accumulated in float32. None where the kernel
    does not apply (as int4_gemm; also a group other than 16 or 32). The weight's form is
    the caller's to have checked (kernels.int8_matmul.check_int8_weight)."""
    if not _takes(x) or not _int8_form(codes, scales, x.shape[1]):
        return None
    M, K = x.shape
    N = codes.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16)
    return _run("int8_gemm", out, x.data_ptr(), x.stride(0), M, K, codes.data_ptr(), scales.data_ptr(),
                None if lows is None else lows.data_ptr(), K // scales.shape[1], N, out.data_ptr(), N)


def int4_gemm_glu(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, act: str) -> torch.Tensor | None:
    """act(x gate^T) * (x up^T) -> [M, I] bfloat16 over a fused 4-bit weight of 2 I rows,
    gate's first (codes, sz as int4_gemm's), each product in float32, rounded once. None
    where int4_gemm would decline, I is not a multiple of 64, or act is not in GLU_ACTS."""
    if not _takes(x) or act not in GLU_ACTS or not _int4_form(codes, sz, x.shape[1], 2 * BLOCK_ROWS):
        return None
    M, K = x.shape
    N = codes.shape[0]
    out = torch.empty(M, N // 2, dtype=torch.bfloat16)
    return _run("int4_gemm_glu", out, x.data_ptr(), x.stride(0), M, K, codes.data_ptr(), sz.data_ptr(), N,
                GLU_ACTS[act], out.data_ptr(), N // 2)


def int8_gemm_glu(x: torch.Tensor, gate: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
                  up: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], act: str) -> torch.Tensor | None:
    """act(x gate^T) * (x up^T) -> [M, N] bfloat16 over two int8 weights (codes, scales,
    lows) of the same shape and group, as int8_gemm reads each. None where int8_gemm
    would decline either, or act is not in GLU_ACTS."""
    (gc, gs, gl), (uc, us, ul) = gate, up
    if (not _takes(x) or act not in GLU_ACTS or not _int8_form(gc, gs, x.shape[1]) or uc.shape != gc.shape
            or us.shape != gs.shape or (gl is None) != (ul is None)):
        return None
    M, K = x.shape
    N = gc.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16)
    return _run("int8_gemm_glu", out, x.data_ptr(), x.stride(0), M, K, gc.data_ptr(), gs.data_ptr(),
                None if gl is None else gl.data_ptr(), uc.data_ptr(), us.data_ptr(),
                None if ul is None else ul.data_ptr(), K // gs.shape[1], N, GLU_ACTS[act], out.data_ptr(), N)
