"""The Triton attention backend's hooks (see headwise.layers.torch_attention); each head
class's module calls the kernels of headwise.kernels.triton_attention for its heads.
Pages are read in place through block tables; ring heads read their ring with the
position each entry holds. Import only when this backend is chosen: Triton reads
TRITON_INTERPRET when the kernels are defined.
"""
from __future__ import annotations

import torch

# Defines the kernels now, when the backend is chosen (a missing Triton fails here).
from headwise.kernels import triton_attention  # noqa: F401
from headwise.layers.context import PagedDecode, StepContext, block_tables

NAME = "triton"
# Paged heads read pages through block tables; ring heads read ring positions.
PAGED = True


def decode_kernel(device: torch.device, spec, compute: torch.dtype) -> bool:
    """Whether decode of a class goes through the torch backend's C kernel (never here)."""
    return False


def fused_decode(layer, ctx: StepContext, q, k, v) -> None:
    """The torch backend's one-call decode of a layer; here decode goes the general way."""
    return None


class StepMetadata:
    """Builds this backend's part of a step: block tables, for decode rows and chunks."""

    def __init__(self, cache, device: torch.device, compute: torch.dtype) -> None:
        self.cache, self.device = cache, device

    def decode(self, seq_ids: list[int], lens: list[int], ring_slots: list[int]) -> PagedDecode:
        meta = PagedDecode()
        if self.cache.has_paged_heads:
            meta.block_tables = block_tables([self.cache.block_table(s) for s in seq_ids], self.device)
        return meta

    def chunk_pages(self, seq_id: int, start: int, length: int) -> torch.Tensor | None:
        if not self.cache.has_paged_heads:
            return None
        return torch.tensor(self.cache.block_table(seq_id), dtype=torch.int32, device=self.device)
