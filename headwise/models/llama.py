"""Decoder-only transformer covering Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm). Parameter names follow the HF checkpoints so weights load as is.
The model owns no cache memory: attention reads the views bound by the cache manager.
"""
from __future__ import annotations

import torch
from torch import nn

from headwise.layers.attention import HeadSplitAttention
from headwise.layers.linear import Linear
from headwise.layers.norm import RMSNorm
from headwise.layers.rotary import RotaryEmbedding
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
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.attn = HeadSplitAttention(H, Hkv, D)
        self.shape = (H, Hkv, D)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # rope: the step's rotary tables (RotaryEmbedding.tables), shared by every layer
        H, Hkv, D = self.shape
        T = x.shape[0]
        q = self.q_proj(x).view(T, H, D)
        k = self.k_proj(x).view(T, Hkv, D)
        v = self.v_proj(x).view(T, Hkv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(rope, q, k)
        return self.o_proj(self.attn(q, k, v).reshape(T, H * D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # down(silu(gate(x)) * up(x)); SiLU and the product run inside the matmuls when packed.
        return self.down_proj(self.up_proj.times(x, self.gate_proj(x, act="silu")))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepare_weights(self, dtype: torch.dtype) -> None:
        """Cast to the compute dtype and prepack the linear weights for the CPU (see
        layers.linear). 4-bit weights are recognised first, while float32 holds them
        exactly. Call once, on the final device, after any edit of the plain weights."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.find_int4()
        self.to(dtype)
        for m in linears:
            m.pack()

    def attention_layers(self) -> list[HeadSplitAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T]; returns float32 logits [len(logits_indices), V]
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary.tables(positions)  # gathered once per step, not per layer
        for layer in self.model.layers:
            x = layer(x, rope)
        # Only rows that are sampled go through the norm and the vocabulary projection.
        x = self.model.norm(x[logits_indices])
        return self.lm_head(x).float()
