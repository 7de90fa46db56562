"""Gemma 3 text decoder layer: a norm before and after each sublayer ("sandwich"), norms
in float32 with weights stored as 1 + w, q/k RMSNorm per head, GeGLU. What else differs
from Llama is configuration (models.config): head_dim given, scaled and tied
embeddings, the attention scale from query_pre_attn_scalar, and sliding-window layers
with their own rotary base, which a head layout models as window heads.
"""
from __future__ import annotations

import torch
from torch import nn

from headwise.layers.norm import RMSNorm
from headwise.models.config import ModelConfig
from headwise.models.llama import MLP, SelfAttention


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, upcast=True)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(hidden, eps, upcast=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, upcast=True)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, upcast=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
