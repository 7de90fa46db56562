"""Attention backends, chosen once when the engine is built: a module with its NAME (the
key each head class picks its attention functions by), PAGED, and the hooks
decode_kernel and fused_decode (see layers.torch_attention)."""
from __future__ import annotations

from types import ModuleType

BACKENDS = ("torch", "triton")


def attention_backend(name: str) -> ModuleType:
    if name == "torch":
        from headwise.layers import torch_attention

        return torch_attention
    if name == "triton":
        # Imported on demand: Triton reads TRITON_INTERPRET when the kernels are defined.
        from headwise.layers import triton_backend

        return triton_backend
    raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
