"""Reorder a finished model's attention heads to a layout's storage order.

Per layer, KV heads go full first, then window heads grouped by (sink, window); each KV
head carries its group of query heads. Permuting q/k/v rows and o_proj columns leaves the
model's function unchanged and makes every head class a contiguous slice at run time.
"""
from __future__ import annotations

import torch

from headwise.cache.layout import HeadLayout
from headwise.models.causal_lm import CausalLM


def _rows(weight: torch.Tensor, order: list[int], head_dim: int) -> torch.Tensor:
    idx = torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim, device=weight.device) for h in order])
    return weight.index_select(0, idx)


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
            proj.weight.copy_(_rows(proj.weight, order, D))
            if proj.bias is not None:
                proj.bias.copy_(_rows(proj.bias, order, D))
        att.o_proj.weight.copy_(_rows(att.o_proj.weight.t(), q_order, D).t())
