"""The decoder-only causal LM every supported architecture builds: embeddings, a stack of
its decoder layers, the final norm and the vocabulary projection. Architecture differences
live in the layer classes (models.llama, models.gemma3) and in ModelConfig.
"""
from __future__ import annotations

import torch
from torch import nn

from headwise.layers.attention import HeadSplitAttention
from headwise.layers.embedding import Embedding
from headwise.layers.int4 import INT4_DTYPES
from headwise.layers.linear import INT8_DTYPES, FusedInt4, Linear
from headwise.layers.norm import RMSNorm
from headwise.layers.rotary import RotaryEmbedding
from headwise.models.config import ModelConfig
from headwise.models.gemma3 import Gemma3DecoderLayer
from headwise.models.llama import DecoderLayer

LAYER_CLASSES = {"gemma3": Gemma3DecoderLayer}


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        layer_cls = LAYER_CLASSES.get(cfg.architecture, DecoderLayer)
        self.layers = nn.ModuleList(layer_cls(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, upcast=cfg.sandwich_norms)
        self.embed_scale = cfg.hidden_size ** 0.5 if cfg.scale_embeddings else None
        # Each layer's rotary base; layers sharing one share its tables in a step.
        self.layer_theta = [cfg.rope_theta_of(i) for i in range(cfg.num_layers)]
        self.build_rotary(cfg)

    def build_rotary(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        """Rotary tables per distinct base, on `device` (None: the default device, the CPU
        where that is meta: a model built there to be loaded; call again with its real
        device. On meta, the tables' reference ops would import torch._dynamo: 1.4 s)."""
        if device is None:
            device = torch.empty(0).device
            device = "cpu" if device.type == "meta" else device
        with torch.device(device):
            self.rotaries = {theta: RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta,
                                                    cfg.rope_scaling if theta == cfg.rope_theta else None)
                             for theta in dict.fromkeys(self.layer_theta)}

    @property
    def rotary(self) -> RotaryEmbedding:
        """The one rotary of a model whose layers all share a base (re-based window
        positions need it; the engine refuses them for models with several bases)."""
        if len(self.rotaries) != 1:
            raise ValueError("this model's layers rotate with different bases: "
                             f"{sorted(self.rotaries)}")
        return next(iter(self.rotaries.values()))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepare_weights(self, dtype: torch.dtype, dense: bool = True) -> None:
        """Cast to the compute dtype and prepack the linear weights for the CPU (see
        layers.linear). The 4-bit copies (else int8 ones) are taken first: from the file's
        codes where the loader read them (layers.quant), else found in the float32
        weights, which hold them exactly only before rounding to 16 bits. Weights a lazy
        load left as codes are made dense here, each straight in `dtype`. float32 norms keep
        their float32 weights; an int8 token embedding is then looked up from its codes
        (layers.embedding). dense=False: a weight with codes every call can read (a 4-bit
        copy, its own or its fusion's, or an int8 one: Linear.codes_suffice) keeps only
        those (bfloat16 activations only, on the CPU; otherwise dense as usual). Call once,
        on the final device, after any edit of the weights."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        embed = self.model.embed_tokens
        tied = self.config.tie_word_embeddings
        keep_codes = not dense and dtype in INT4_DTYPES
        # Kept as codes only, a layer lets go of its file's codes (int8, a byte per weight)
        # as soon as they are packed (half a byte), not after every layer is: a cold start
        # then never holds the whole model both ways (Qwen2.5-Coder-1.5B: peak while
        # preparing 4.2 -> 3.2 GB).
        codes_only: set[Linear] = set()

        def keep_codes_only(m: Linear) -> None:
            if keep_codes and m.packable() and m.codes_suffice(dtype):  # on the CPU (the kernels' device)
                m.keep_codes_only(dtype)
                codes_only.add(m)

        for m in [m for m in self.modules() if hasattr(m, "fuse_int4")]:
            fused = m.fuse_int4()  # q/k/v and gate/up as one 4-bit matmul each, where exactly 4-bit
            if keep_codes and fused.int4 is not None:
                fused.keep_codes_only()
                codes_only.update(fused.parts)
        for m in linears:  # the others (and the parts of a fusion that did not apply)
            m.find_int4()
            m.find_int8()  # where there is no 4-bit copy
            keep_codes_only(m)
        embed.find_int8(self.lm_head if tied else None)  # shares the tied projection's int8 copy
        if tied and self.lm_head not in codes_only:  # the projection packs the embedding's dense weight
            embed.materialize(dtype)
            self.lm_head.weight = embed.weight
        kept = {m: m.weight.data.float() for m in self.modules() if isinstance(m, RMSNorm) and m.upcast}
        # float32 scales and minimums of the int8 copies: exact
        scales = {m: (m.int8_scales, m.int8_lows) for m in linears + [embed] if m.int8_scales is not None}
        self.to(dtype)
        for m, w in kept.items():
            m.weight.data = w
        for m, (sc, lows) in scales.items():
            m.int8_scales, m.int8_lows = sc, lows
        for m in self.modules():
            if isinstance(m, FusedInt4):
                m.cast(dtype)
        # One plain dense weight at a time, made in one scratch buffer that packing reads
        # and lets go of: fresh memory for each would be zeroed by the kernel first, which
        # was most of the time Qwen2.5-Coder-1.5B's weights took to prepare.
        sizes = [m.quant.codes.numel() for m in linears if m.weight is None and m.quant is not None]
        scratch = torch.empty(max(sizes), dtype=dtype) if sizes and dtype in (torch.float32, torch.bfloat16) else None
        for m in linears:
            if m in codes_only:
                continue
            m.materialize(dtype, scratch)
            if (not m.pack() and scratch is not None and m.weight is not None
                    and m.weight.untyped_storage().data_ptr() == scratch.untyped_storage().data_ptr()):
                m.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=False)  # kept, so off the scratch
        embed.compact(dtype, INT8_DTYPES)

    def attention_layers(self) -> list[HeadSplitAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T]; returns float32 logits [len(logits_indices), V]
        return self.logits(self.hidden_states(input_ids, self.rope_tables(positions)), logits_indices)

    def rope_tables(self, positions: torch.Tensor) -> dict[float, tuple[torch.Tensor, torch.Tensor]]:
        """Each rotary base's (cos, sin) [T, 1, D/2] of the step's positions [T], gathered
        once per step, not per layer (and outside a captured graph: tables are inputs)."""
        return {theta: r.tables(positions) for theta, r in self.model.rotaries.items()}

    def hidden_states(self, input_ids: torch.Tensor,
                      tables: dict[float, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """[T] token ids and their rotary tables (rope_tables) -> the last layer's output
        [T, hidden] (the part engine.decode_capture compiles)."""
        m = self.model
        x = m.embed_tokens(input_ids)
        if m.embed_scale is not None:
            x = x * torch.tensor(m.embed_scale, dtype=x.dtype)  # rounded as the reference does
        for layer, theta in zip(m.layers, m.layer_theta):
            x = layer(x, tables[theta])
        return x

    def logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        # Only rows that are sampled go through the norm and the vocabulary projection.
        return self.lm_head(self.model.norm(x[logits_indices])).float()
