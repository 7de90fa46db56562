"""What the cache stores, described once: per head class (dtype, bytes per token) and
the whole cache's geometry (which heads of which layer live where, how many blocks and
ring slots the budget buys). The manager computes it; the runner allocates storage from
it; accounting (kv_bytes, usage, admission) reads it. Nothing here holds a tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from headwise.heads.base import RingKind
from headwise.heads.layout import KV_CACHE_DTYPES, KV_DTYPE_KEYS, HeadLayout, kv_dtypes

# Storage dtype of each KV cache dtype name ("auto": the compute dtype).
_STORAGE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QUANTIZED = ("int8", "fp8_e4m3")


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVClassSpec:
    """Storage of one head class: every byte figure of a class comes from here.
    Quantized classes (scale_dtype set) keep one symmetric scale per token and head for
    K and one for V, in the compute dtype, beside the values (x ~ q * scale)."""
    name: str              # the storage kind: "paged" | "ring"
    dtype: torch.dtype     # storage dtype of the values
    head_dim: int
    scale_dtype: torch.dtype | None = None

    @classmethod
    def resolve(cls, name: str, kv_cache_dtype: str, compute: torch.dtype, head_dim: int) -> "KVClassSpec":
        """A head class stored as `kv_cache_dtype` (see KV_CACHE_DTYPES) by a model
        computing in `compute`."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        if kv_cache_dtype == "auto":
            return cls(name, compute, head_dim)
        return cls(name, _STORAGE[kv_cache_dtype], head_dim,
                   compute if kv_cache_dtype in QUANTIZED else None)

    @property
    def element_size(self) -> int:
        return _size(self.dtype)

    @property
    def scale_size(self) -> int:
        """Bytes of one scale (0: not quantized)."""
        return _size(self.scale_dtype) if self.scale_dtype is not None else 0

    @property
    def bytes_per_head_token(self) -> int:
        """K and V of one token of one head, scales included."""
        return 2 * (self.head_dim * self.element_size + self.scale_size)

    @property
    def label(self) -> str:
        """Names the stored format (prefix-cache keys and tier fingerprints differ by it)."""
        s = str(self.dtype).removeprefix("torch.")
        return s if self.scale_dtype is None else f"{s}*{str(self.scale_dtype).removeprefix('torch.')}"


def class_specs(layout: HeadLayout, kv_cache_dtype: str, compute: torch.dtype) -> tuple[KVClassSpec, KVClassSpec]:
    """(paged pool, rings) specs, named by storage kind: the layout's kv_dtype where it
    sets one, else the option."""
    chosen = kv_dtypes(layout.kv_dtype, layout.name) or {}
    return tuple(KVClassSpec.resolve(k, chosen.get(k, kv_cache_dtype), compute, layout.head_dim)
                 for k in KV_DTYPE_KEYS)


@dataclass(frozen=True)
class GroupSpec:
    """A run of heads of one layer of one class and parameters (HeadSpec.group_key),
    contiguous in storage order (see HeadLayout.head_order)."""
    kind: str              # the head class
    kv_start: int          # first KV head of the group within the layer (storage order)
    kv_end: int
    sink: int
    window: int
    ring_size: int         # ring classes: tokens per head per sequence; 0 for paged ones
    offset: int            # paged: first head of the group in the pool; ring: element
                           # offset of the group within one ring slot's K (or V)
    budget: int = 0        # select classes: tokens attended per decode step
    summary_offset: int = -1  # classes with page summaries (HeadClass.page_summary): first
                              # head of the group among the pool's summarised heads; else -1

    @property
    def num_heads(self) -> int:
        return self.kv_end - self.kv_start

    @property
    def paged(self) -> bool:
        return self.ring_size == 0

    @property
    def summarised(self) -> bool:
        return self.summary_offset >= 0

    @property
    def ring_kind(self) -> RingKind:
        return RingKind(self.kind, self.sink, self.window)


@dataclass(frozen=True)
class CacheGeometry:
    """Where every head's KV lives. Paged heads (every token): one pool [F, num_blocks *
    block_size, D] for K and one for V, layer l owning heads [paged_offset[l],
    paged_offset[l] + num_paged[l]). Ring heads: per ring slot, ring_elems elements of K
    then of V, laid out group by group (see KVStorage in the runner)."""
    block_size: int
    num_paged: tuple[int, ...]                     # [L] paged KV heads per layer
    paged_offset: tuple[int, ...]                  # [L] first paged head of layer l in the pool
    groups: tuple[tuple[GroupSpec, ...], ...]      # [L] every head group of the layer
    paged: KVClassSpec                             # storage of the paged heads (full, select)
    ring: KVClassSpec                              # storage of the ring heads (window)

    @classmethod
    def from_layout(cls, layout: HeadLayout, block_size: int, paged: KVClassSpec,
                    ring: KVClassSpec) -> "CacheGeometry":
        num_paged, offsets, groups = [], [], []
        F = E = S = 0
        for l in range(layout.num_layers):
            nf = layout.num_paged(l)
            offsets.append(F)
            num_paged.append(nf)
            row = layout.heads[l]
            runs: list[list] = []  # [kv_start, kv_end, spec]
            for pos, h in enumerate(layout.head_order(l)):
                if runs and runs[-1][2].group_key == row[h].group_key:
                    runs[-1][1] = pos + 1
                else:
                    runs.append([pos, pos + 1, row[h]])
            layer_groups = []
            for a, b, s in runs:
                summarised = s.paged and s.head_class.page_summary
                layer_groups.append(GroupSpec(s.kind, a, b, s.sink, s.window, s.ring_size,
                                              F + a if s.paged else E, s.budget if summarised else 0,
                                              S if summarised else -1))
                if not s.paged:
                    E += (b - a) * s.ring_size * layout.head_dim
                if summarised:
                    S += b - a
            F += nf
            groups.append(tuple(layer_groups))
        return cls(block_size, tuple(num_paged), tuple(offsets), tuple(groups), paged, ring)

    @property
    def total_paged_heads(self) -> int:
        return sum(self.num_paged)

    @property
    def ring_groups(self) -> list[GroupSpec]:
        return [g for gs in self.groups for g in gs if not g.paged]

    @property
    def ring_tokens(self) -> int:
        """Head-tokens in one ring slot (ring_size of every ring head of every layer)."""
        return sum(g.num_heads * g.ring_size for g in self.ring_groups)

    @property
    def ring_elems(self) -> int:
        """Elements of K (or of V) in one ring slot."""
        return self.ring_tokens * self.ring.head_dim

    @property
    def summary_heads(self) -> int:
        """Paged heads whose class keeps a key summary per block (HeadClass.page_summary)."""
        return sum(g.num_heads for gs in self.groups for g in gs if g.summarised)

    @property
    def summary_dtype(self) -> torch.dtype:
        """Per-channel key min and max of a block: exact in the pool's own dtype when K is
        stored plainly; float32 over dequantized keys when quantized."""
        return self.paged.dtype if self.paged.scale_dtype is None else torch.float32

    @property
    def block_bytes(self) -> int:
        """One block: block_size tokens of every paged head of every layer, K and V, and
        the key summaries (min and max per channel) of its summarised heads."""
        summaries = self.summary_heads * 2 * self.paged.head_dim * _size(self.summary_dtype)
        return self.total_paged_heads * self.block_size * self.paged.bytes_per_head_token + summaries

    @property
    def select_block_bytes(self) -> int:
        """K and V of one block of the summarised (select) heads: the part of a block that
        waits in host memory when select pages do (select_host_pages)."""
        return self.summary_heads * self.block_size * self.paged.bytes_per_head_token

    @property
    def select_step_pages(self) -> int:
        """The most pages one select head attends for one sequence in a decode step: its
        budget's, or its sink's and window's when more (heads.select.forced_pages)."""
        bs = self.block_size
        return max((max(g.budget // bs, -(-g.sink // bs) + -(-g.window // bs) + 1)
                    for gs in self.groups for g in gs if g.summarised), default=0)

    @property
    def ring_bytes(self) -> int:
        """One ring slot: sink + window tokens of every window head, K and V, scales included."""
        return self.ring_tokens * self.ring.bytes_per_head_token

    def seq_bytes(self, num_tokens: int) -> int:
        """KV bytes one sequence of `num_tokens` tokens holds: its blocks and its ring."""
        blocks = -(-num_tokens // self.block_size) if self.total_paged_heads else 0
        return blocks * self.block_bytes + self.ring_bytes

    def ring_kinds(self) -> list[RingKind]:
        """Distinct ring classes with their parameters: per-step ring metadata is built
        once for each, not per layer."""
        return sorted({g.ring_kind for g in self.ring_groups})
