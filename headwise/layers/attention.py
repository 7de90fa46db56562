"""Head-split attention over the cache views the model runner binds into each layer.

Within a layer the KV heads are ordered in groups of one head class and parameters
(paged classes first, see HeadLayout.head_order); the model's projection weights are
permuted to match at load time (see headwise.models.head_order), so every group is a
contiguous slice. The layer hands each group to its class (headwise.heads), which writes
the group's cache and attends it with the bound backend. Cache views are KVTensors
(layers.kv_tensor): a quantized class's K/V are written once, quantized, and the step's
own K/V are attended in their round-tripped form, as later reads will see them.

Under torch.compile (engine.decode_capture) the layer is one opaque custom op,
headwise::attention: the cache writes and the backend's data-dependent Python run as they
do eagerly, and the code around them is compiled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

from headwise.layers import opaque
from headwise.layers.context import get_context
from headwise.layers.kv_tensor import KVTensor, take


@torch.library.custom_op("headwise::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    """HeadSplitAttention.attend of the layer whose op_key is `layer` (see layers.opaque).
    Its cache writes are the layer's own state, which nothing else in a graph touches."""
    return opaque.lookup(layer).attend(q, k, v)


@attention_op.register_fake
def _(q, k, v, layer):
    return torch.empty_like(q)


@dataclass
class HeadGroup:
    """One layer's view of one head group's cache (see CacheGeometry.groups)."""
    head_class: Any        # its headwise.heads.base.HeadClass
    kv_start: int          # first KV head of the group within the layer
    kv_end: int
    sink: int              # the class's parameters (those it has)
    window: int
    k: KVTensor            # paged: [n, slots, D]; ring: [num_ring_slots, n, ring_size, D]
    v: KVTensor
    kv: torch.Tensor | None = None  # K and V values together, [2, ...] (one write of
                                    # both); None when quantized
    budget: int = 0                 # select classes: tokens attended per decode step
    summary: torch.Tensor | None = None  # classes with page summaries: [num_blocks, n, 2, D]
                                         # per-channel key min and max of each block
    hot: Any = None  # select heads whose pages wait in host memory (k, v above): their
                     # hot set on the device, an engine.hot_pages.HotView
    state: dict = field(default_factory=dict)  # what the class keeps per group (its kernel calls)

    @property
    def num_heads(self) -> int:
        return self.kv_end - self.kv_start

    @property
    def paged(self) -> bool:
        return self.head_class.storage == "paged"  # heads.base.PAGED

    @property
    def ring_kind(self) -> tuple[str, int, int]:
        """(class, sink, window): the key of the step's ring metadata (heads.base.RingKind)."""
        return self.head_class.name, self.sink, self.window


class HeadSplitAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale  # of q.k
        # Bound by the model runner; the layer never allocates cache memory.
        self.groups: list[HeadGroup] = []
        self.backend: ModuleType | None = None
        self.backend_state = None
        # Optional callback (q, k, v) used by calibration to read a layer's heads.
        self.observer = None

    def bind(self, groups: list[HeadGroup], backend: ModuleType) -> None:
        self.groups = groups
        self.backend = backend
        self.backend_state = None  # whatever the backend keeps per layer (built on first use)
        caches = [g.k for g in groups]
        # When every group of the layer stores K/V alike, the step's K/V are encoded
        # once for all heads (a quantized step is a dozen small ops per call).
        self._shared = caches[0] if all(c.format == caches[0].format for c in caches) else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] (rotary already applied) -> [T, Hq, D]
        if torch.compiler.is_dynamo_compiling():
            return attention_op(q, k, v, self.op_key)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.observer is not None:
            self.observer(q, k, v)
        ctx = get_context()
        if ctx.dry_run:  # a compile warm-up: shapes only, the cache untouched
            return torch.zeros_like(q)
        fused = self.backend.fused_decode(self, ctx, q, k, v)
        if fused is not None:
            return fused
        out = torch.empty_like(q)
        g = self.group
        # Stored forms (values, scales) of the step's K and V, per group.
        shared = None if self._shared is None else self._shared.encode_kv(k, v)

        def forms(cache: KVTensor, heads: slice):
            if shared is None:
                return cache.encode_kv(k[:, heads], v[:, heads])
            return tuple(take(f, lambda t: t[:, heads]) for f in shared)

        for grp in self.groups:
            qs = slice(grp.kv_start * g, grp.kv_end * g)
            ks = slice(grp.kv_start, grp.kv_end)
            grp.head_class.attend(self, grp, ctx, q[:, qs], *forms(grp.k, ks), out[:, qs])
        return out
