"""Decoder layer of Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k
RMSNorm), and the attention and MLP blocks every supported architecture shares.
Parameter names follow the HF checkpoints so weights load as is. The model owns no cache
memory: attention reads the views bound by the cache manager.
"""
from __future__ import annotations

import torch
from torch import nn

from headwise.layers.attention import HeadSplitAttention
from headwise.layers.linear import FusedInt4, Linear, activate, int8_glu
from headwise.layers.norm import RMSNorm
from headwise.layers.rotary import RotaryEmbedding, rotate
from headwise.models.config import ModelConfig


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, H, Hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, H * D, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, Hkv * D, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, Hkv * D, bias=bias)
        self.o_proj = Linear(H * D, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, upcast=cfg.sandwich_norms)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, upcast=cfg.sandwich_norms)
        self.qk_norm = cfg.qk_norm
        self.attn = HeadSplitAttention(H, Hkv, D, cfg.attention_scale)
        self.shape = (H, Hkv, D)
        self.qkv_int4: FusedInt4 | None = None

    def fuse_int4(self) -> FusedInt4:
        """q, k and v as one 4-bit matmul for decode (see FusedInt4); weights still float32."""
        self.qkv_int4 = FusedInt4([self.q_proj, self.k_proj, self.v_proj])
        return self.qkv_int4

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # rope: the step's rotary tables for this layer (RotaryEmbedding.tables)
        H, Hkv, D = self.shape
        T = x.shape[0]
        fused = self.qkv_int4 is not None and self.qkv_int4.applies(x)
        if fused:  # decode: one matmul, q, k and v side by side [T, H + 2 Hkv, D]
            qkv = self.qkv_int4(x).view(T, H + 2 * Hkv, D)
            q, k, v = qkv.split([H, Hkv, Hkv], dim=1)
        else:
            q = self.q_proj(x).view(T, H, D)
            k = self.k_proj(x).view(T, Hkv, D)
            v = self.v_proj(x).view(T, Hkv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if fused and not self.qk_norm:  # q and k still adjacent: rotated in one pass
            qk = rotate(qkv[:, : H + Hkv], *rope)
            q, k = qk[:, :H], qk[:, H:]
        else:
            q, k = RotaryEmbedding.apply(rope, q, k)
        return self.o_proj(self.attn(q, k, v).reshape(T, H * D))


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (gelu_tanh)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = cfg.hidden_act
        self.gate_up_int4: FusedInt4 | None = None

    def fuse_int4(self) -> FusedInt4:
        """gate and up as one 4-bit matmul for decode (see FusedInt4)."""
        self.gate_up_int4 = FusedInt4([self.gate_proj, self.up_proj])
        return self.gate_up_int4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up_int4
        if fused is not None and fused.applies(x):
            h = fused.glu(x, self.act)  # the activation and product inside the matmul: weights kept as codes
            if h is None:
                gate, up = fused(x).split(fused.sizes, dim=-1)
                h = activate(gate, self.act) * up
            return self.down_proj(h)
        h = int8_glu(self.gate_proj, self.up_proj, x, self.act)  # the same over int8 codes
        if h is None:  # the activation and the product run inside the matmuls when packed
            h = self.up_proj.times(x, self.gate_proj(x, act=self.act))
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add(x, self.self_attn(self.input_layernorm(x), rope))
        return x + self.mlp(h)
