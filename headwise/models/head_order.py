"""Reorder a finished model's attention heads to a layout's storage order.

Per layer, KV heads go full first, then window heads grouped by (sink, window); each KV
head carries its group of query heads. Permuting q/k/v rows and o_proj columns leaves the
model's function unchanged and makes every head class a contiguous slice at run time.
"""
from __future__ import annotations

import torch

from headwise.heads.layout import HeadLayout
from headwise.layers.linear import Linear
from headwise.models.causal_lm import CausalLM


def _index(order: list[int], head_dim: int) -> torch.Tensor:
    # rows (or columns) of the heads in `order`, head_dim each
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in order])


@torch.no_grad()
def permute_model_heads(model: CausalLM, layout: HeadLayout) -> None:
    cfg = model.config
    g, D = cfg.group_size, cfg.head_dim
    for l, layer in enumerate(model.model.layers):
        kv_order = layout.head_order(l)
        if kv_order == sorted(kv_order):
            continue
        q_order = [h * g + j for h in kv_order for j in range(g)]
        att = layer.self_attn
        for proj, order in ((att.q_proj, q_order), (att.k_proj, kv_order), (att.v_proj, kv_order)):
            _permute(proj, _index(order, D), 0)
            if proj.bias is not None:
                proj.bias.copy_(proj.bias.index_select(0, _index(order, D).to(proj.bias.device)))
        _permute(att.o_proj, _index(q_order, D), 1)


def _permute(proj: Linear, idx: torch.Tensor, dim: int) -> None:
    """proj's weight rows (dim 0) or columns (1) in the order `idx`; the file's codes
    (layers.quant) move along, or are dropped where columns split their groups (the decode
    copy is then searched for in the dense weight)."""
    if proj.quant is not None:
        moved = proj.quant.take_rows(idx) if dim == 0 else proj.quant.take_columns(idx)
        if moved is None and proj.weight is None:
            proj.materialize(torch.float32)  # loaded lazily: the dense weight moves instead
        proj.quant = moved
    if proj.weight is not None:
        proj.weight.copy_(proj.weight.index_select(dim, idx.to(proj.weight.device)))
