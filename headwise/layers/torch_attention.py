"""The PyTorch attention backend (CPU, and any device without Triton): what every head
class's torch attention shares (headwise.heads.*: each class module holds its own decode
and prefill for each backend).

Two hooks every backend has:
    decode_kernel(device, spec, compute) -> bool: whether decode of a pool stored as
        `spec` (a KVClassSpec) goes through the C kernel, so the runner builds its metadata
    fused_decode(layer, ctx, q, k, v) -> [B, Hq, D] or None: a whole decode-only step of
        a layer (writes and attention), or None, and each group's class attends it.
On the CPU, decode rows go through headwise's C kernel (kernels/cpu_decode.c): a
decode-only step in fused_decode, the decode rows of a step with prefill chunks in the
classes' decode (kernel_takes); the classes' PyTorch code serves where the kernel does
not (no compiler, caches it does not take, re-based positions). Caches are KVTensors:
decode attends a quantized cache in its stored form (scaled_attention), other reads
dequantize only the sequence or ring at hand.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from headwise.kernels import cpu_kernels
from headwise.layers.attention import HeadGroup, HeadSplitAttention
from headwise.layers.context import PagedDecode, StepContext, block_tables
from headwise.layers.kv_tensor import KVTensor

NAME = "torch"
# Paged heads read slot runs and gathered slots; window heads read band masks.
PAGED = False


@dataclass
class TorchDecode(PagedDecode):
    """What this backend reads of a step's decode rows (StepContext.decode)."""
    # block_tables: where the C kernel attends the paged heads, or select heads choose pages
    min_len: int = 0                                     # min(decode_lens), on the host
    ring_slots: list[int] = field(default_factory=list)  # decode_ring_slots, on the host
    runs: list[list[tuple[int, int]]] | None = None      # paged heads without the C kernel:
                                                         # per sequence, (first slot, length)
    lens_i32: torch.Tensor | None = None                 # [B] int32 decode_lens (C kernel)
    ring_table: torch.Tensor | None = None               # [B, 1] int32 ring slots (C kernel)


class StepMetadata:
    """Builds this backend's part of a step from the cache manager's plain data: whether
    the C kernel attends each pool decides between block tables and slot runs."""

    def __init__(self, cache, device: torch.device, compute: torch.dtype) -> None:
        geo = cache.geometry
        self.cache, self.device = cache, device
        self.paged_by_kernel = decode_kernel(device, geo.paged, compute) and cache.has_paged_heads
        self.tables = self.paged_by_kernel or geo.summary_heads > 0
        self.kernel = self.paged_by_kernel or decode_kernel(device, geo.ring, compute)

    def decode(self, seq_ids: list[int], lens: list[int], ring_slots: list[int]) -> TorchDecode:
        cache, dev = self.cache, self.device
        meta = TorchDecode(min_len=min(lens), ring_slots=ring_slots)
        if self.tables:
            meta.block_tables = block_tables([cache.block_table(s) for s in seq_ids], dev)
        if cache.has_paged_heads and not self.paged_by_kernel:
            meta.runs = [cache.slot_runs(s, n) for s, n in zip(seq_ids, lens)]
        if self.kernel:
            meta.lens_i32 = torch.tensor(lens, dtype=torch.int32, device=dev)
            meta.ring_table = torch.tensor(ring_slots, dtype=torch.int32, device=dev)[:, None]
        return meta

    def chunk_pages(self, seq_id: int, start: int, length: int) -> torch.Tensor | None:
        """A chunk after the first gathers every earlier slot of its sequence."""
        if not start or not self.cache.has_paged_heads:
            return None
        return torch.tensor(self.cache.slot_mapping(seq_id, 0, start + length), dtype=torch.int64,
                            device=self.device)


def decode_kernel(device: torch.device, spec, compute: torch.dtype) -> bool:
    """Whether decode of a head class stored as `spec` attends through the C kernel
    (kernels/cpu_decode.c): on the CPU where it compiled, a storage it takes. It then
    needs block tables and int32 lengths, not slot runs."""
    return (device.type == "cpu" and cpu_kernels.takes(compute, spec.dtype, spec.scale_dtype, spec.head_dim)
            and cpu_kernels.library() is not None)


def pool_call(k: KVTensor, v: KVTensor, block_size: int, g: int, head: int = 0) -> cpu_kernels.DecodeCall:
    """The C kernel's call for a paged group: K/V [n, slots, D] (+ scales [n, slots]), the
    group being KV heads [head, head + n) of the queries it is given."""
    scales = None if k.scale is None else (k.scale, v.scale, block_size * k.scale.stride(1))
    return cpu_kernels.DecodeCall(k.data, v.data, block_size, block_size * k.data.stride(1), g, head,
                                  scales=scales)


def ring_call(wg: HeadGroup, g: int, head: int) -> cpu_kernels.DecodeCall:
    """The C kernel's call for a ring group's rings [S, n, R, D] (+ scales [S, n, R]),
    the group being KV heads [head, head + n) of the queries it is given."""
    k, v = wg.k.data.transpose(0, 1), wg.v.data.transpose(0, 1)  # [n, S, R, D]
    scales = None
    if wg.k.scale is not None:
        ks, vs = wg.k.scale.transpose(0, 1), wg.v.scale.transpose(0, 1)  # [n, S, R]
        scales = (ks, vs, ks.stride(1))
    R = k.shape[2]
    return cpu_kernels.DecodeCall(k, v, R, k.stride(1), g, head, cap=R, scales=scales)


class KernelCalls:
    """A layer's C-kernel calls (cpu_kernels.DecodeCall), one per head group of a class
    that allows it (HeadClass.fused_decode): a paged group's reads the block pool through
    block tables, a ring group's its rings (with its (sink, window), whose ring entry the
    new token takes). Groups of other classes (`own`) are attended by their class in the
    same step. Built on the layer's first decode step; a layer whose caches the kernel
    does not take (fp8, another dtype), or with no group it takes, gets none and keeps
    the code below."""

    def __init__(self, layer: HeadSplitAttention, q: torch.Tensor, block_size: int) -> None:
        fused = [grp for grp in layer.groups if grp.head_class.fused_decode]
        self.ok = bool(fused) and all(cpu_kernels.usable(q, grp.k) for grp in layer.groups)
        if not self.ok:
            return
        g = layer.group
        # Ring groups with their kind (whose ring entry the new token takes).
        self.paged = [pool_call(grp.k, grp.v, block_size, g, grp.kv_start) for grp in fused if grp.paged]
        self.rings = [(ring_call(grp, g, grp.kv_start), grp.ring_kind) for grp in fused if not grp.paged]
        # (group, its query heads, its KV heads)
        self.own = [(grp, slice(grp.kv_start * g, grp.kv_end * g), slice(grp.kv_start, grp.kv_end))
                    for grp in layer.groups if not grp.head_class.fused_decode]


def kernel_takes(q: torch.Tensor, cache: KVTensor, ctx: StepContext) -> bool:
    """Whether the C kernel attends these decode rows (StepMetadata built its metadata)."""
    return ctx.decode.lens_i32 is not None and cpu_kernels.usable(q, cache)


def fused_decode(layer: HeadSplitAttention, ctx: StepContext, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor | None:
    """A decode-only step of one layer (q [B, Hq, D]; k, v [B, Hkv, D]): each class's cache
    write and attention in one C call, into one output [B, Hq, D]; or None where it does
    not apply (prefill chunks in the step, re-based positions, no kernel, caches it does
    not take), and the layer goes the general way."""
    meta = ctx.decode
    if ctx.prefills or meta is None or meta.lens_i32 is None or ctx.sink_rope:
        return None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or not q.dtype == k.dtype == v.dtype:
        return None
    calls = layer.backend_state
    if calls is None:
        calls = layer.backend_state = KernelCalls(layer, q, ctx.block_size)
    if not calls.ok:
        return None
    out = torch.empty_like(q)
    lens = meta.lens_i32
    for call in calls.paged:  # the new token's key row is its position
        call(q, out, meta.block_tables, lens, layer.scale, (k, v, ctx.positions))
    for call, kind in calls.rings:
        call(q, out, meta.ring_table, lens, layer.scale, (k, v, ctx.decode_ring_index[kind]))
    for grp, qs, ks in calls.own:
        grp.head_class.attend(layer, grp, ctx, q[:, qs], *grp.k.encode_kv(k[:, ks], v[:, ks]), out[:, qs])
    return out


def scaled_attention(q, k: KVTensor, v: KVTensor, scale: float, valid: torch.Tensor | None = None,
                     q_sink=None) -> torch.Tensor:
    """Decode attention over quantized K/V in their stored form: per-token scales multiply
    the scores and the probabilities instead of the values, so no scaled copy of K or V
    is written (int8 and fp8 convert to float32 exactly). All in float32: the scores are
    as exact as SDPA's, and float32 matmuls of a length that changes every step run
    without the ~0.5 ms oneDNN spends on each new bfloat16 matmul shape on this CPU.
    q [*, n, g, D]; k, v [*, n, L, D] (+ scales [*, n, L]); valid [*, L] or None;
    q_sink (query for the entries [0, sink), sink) or None -> [*, n, g, D] in q's dtype."""
    kq, vq = k.data.float(), v.data.float()
    kscale = (k.scale.float() * scale).unsqueeze(-2)  # [*, n, 1, L]
    s = torch.matmul(q.float(), kq.transpose(-1, -2)).mul_(kscale)  # [*, n, g, L]
    if q_sink is not None:
        qs, sk = q_sink
        s[..., :sk] = torch.matmul(qs.float(), kq[..., :sk, :].transpose(-1, -2)) * kscale[..., :sk]
    if valid is not None:
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).mul_(v.scale.float().unsqueeze(-2))
    return torch.matmul(p, vq).to(q.dtype)


def attend(q, k, v, bias: torch.Tensor, scale: float,
           fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp. q: [B, H, L, D]; k, v: [B, H, S, D]; bias: additive
    (see window_geometry.bias), broadcastable to [B, H, L, S], every row with a finite
    entry. Returns out [B, H, L, D] and lse [B, H, L] (float32). fused (default: on CPU)
    uses PyTorch's fused CPU kernel, which returns the lse it computes."""
    if q.device.type == "cpu" if fused is None else fused:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=bias.expand(*q.shape[:-1], k.shape[-2]), scale=scale)
        return o, lse.float()
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), v), lse
