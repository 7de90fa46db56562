"""Page selection for select heads through cpu_select.c (headwise.heads.select calls
these, and keeps PyTorch's code where they return False or None): the key summaries of
written blocks, and the pages each query group attends within its budget."""
from __future__ import annotations

import torch

from headwise.kernels.cpu_kernels import DTYPES, select_library


def refresh_summaries(k: torch.Tensor, blocks: torch.Tensor, block: int, summary: torch.Tensor) -> bool:
    """cpu_select.c: the key summaries [blocks, n, 2, D] of `blocks` [m] int64 from the
    pool's keys k [n, ..., D], slot s's row at s * stride(-2) (the summary's dtype,
    float32 or bfloat16, unit inner strides). False, nothing written, where the library
    or these inputs do not fit it."""
    lib = select_library()
    if (lib is None or k.device.type != "cpu" or summary.device.type != "cpu" or k.dtype not in DTYPES
            or summary.dtype != k.dtype
            or k.stride(-1) != 1 or summary.stride(-1) != 1 or summary.stride(-2) != summary.shape[-1]
            or blocks.dtype != torch.int64 or k.shape[-1] > 512):
        return False
    blocks = blocks.contiguous()
    n, D = k.shape[0], k.shape[-1]
    rc = lib.refresh_summaries(k.data_ptr(), k.stride(0), k.stride(-2), DTYPES[k.dtype], blocks.data_ptr(),
                               blocks.numel(), n, block, D, summary.data_ptr(), summary.stride(0),
                               summary.stride(1))
    if rc:
        raise RuntimeError(f"cpu_select.refresh_summaries failed ({rc})")
    return True


def select_pages(q: torch.Tensor, summary: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                 block: int, sink: int, window: int, budget_pages: int,
                 K: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cpu_select.c: q [B, n*g, D] and summary [blocks, n, 2, D] (float32 or bfloat16, unit
    inner stride; D a multiple of 16, g at most 16), table [B, W] int32, lens [B] int64 -> (tables [n, B, K], lens [n, B])
    int32; None where the library or these inputs do not fit it. Each sequence takes
    max(budget_pages, its forced pages), which K, the output's width, must hold."""
    lib = select_library()
    if (lib is None or q.device.type != "cpu" or q.dtype not in DTYPES or summary.dtype not in DTYPES
            or q.stride(-1) != 1 or summary.stride(-1) != 1 or summary.stride(-2) != summary.shape[-1]
            or table.dtype != torch.int32 or table.stride(-1) != 1 or q.shape[-1] % 16
            or q.shape[1] // summary.shape[1] > 16):
        return None
    B, H, D = q.shape
    n = summary.shape[1]
    lens = lens.to(torch.int64).contiguous()
    out_t = torch.empty(n, B, K, dtype=torch.int32)
    out_l = torch.empty(n, B, dtype=torch.int32)
    rc = lib.select_pages(q.data_ptr(), q.stride(0), q.stride(1), DTYPES[q.dtype],
                          summary.data_ptr(), summary.stride(0), summary.stride(1), DTYPES[summary.dtype],
                          table.data_ptr(), table.stride(0), lens.data_ptr(), B, n, H // n, D, block, sink,
                          window, budget_pages, K, out_t.data_ptr(), out_l.data_ptr())
    if rc:
        raise RuntimeError(f"cpu_select.select_pages failed ({rc})")
    return out_t, out_l
