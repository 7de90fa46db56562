"""Read a GGUF file: model config from its metadata, weights dequantized to float32
tensors with HF parameter names."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from headwise.models.config import (GEMMA3_LOCAL_ROPE_THETA, SUPPORTED_ARCHITECTURES, ModelConfig,
                                    UnsupportedModelError, gemma3_layer_types)
from headwise.weights.gguf_file import GGUFFile

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has a norm before and after each sublayer; its ffn_norm is the one before.
_GEMMA3_LAYER_NAMES = dict(_LAYER_NAMES, ffn_norm="pre_feedforward_layernorm",
                           post_attention_norm="post_attention_layernorm",
                           post_ffw_norm="post_feedforward_layernorm")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def read_config(reader: GGUFFile, name: str) -> ModelConfig:
    arch = reader.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; headwise supports {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise UnsupportedModelError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not "
                                    "supported; load the Hugging Face directory instead")

    def a(key, default=None):
        return reader.get(f"{arch}.{key}", default)

    heads = a("attention.head_count")
    hidden = a("embedding_length")
    eos = reader.get("tokenizer.ggml.eos_token_id")
    vocab = a("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"])
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    layers = int(a("block_count"))
    head_dim = int(a("attention.key_length", hidden // heads))
    gemma = {}
    if arch == "gemma3":
        # Not in every GGUF: the layer pattern (bools, True = sliding, or a period), the
        # sliding layers' rotary base and query_pre_attn_scalar (head_dim for every
        # Gemma 3 but the 27B, as llama.cpp assumes too).
        pattern = a("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            types = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            types = gemma3_layer_types(layers, *([int(pattern)] if pattern else []))
        gemma = dict(sliding_window=int(a("attention.sliding_window")), layer_types=types,
                     rope_local_theta=float(a("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)),
                     query_pre_attn_scalar=float(head_dim), hidden_act="gelu_tanh",
                     scale_embeddings=True, sandwich_norms=True)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(a("feed_forward_length")),
        num_layers=layers,
        num_heads=int(heads),
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        max_position_embeddings=int(a("context_length", 4096)),
        tie_word_embeddings=not has_output,
        attention_bias=SUPPORTED_ARCHITECTURES[arch]["attention_bias"],
        qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        name=name,
        **gemma,
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each Llama/Mistral q/k
    # head; undo it so the weights match the half-split rotary used here.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def load_gguf(path: Path, name: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = GGUFFile(path)
    cfg = read_config(reader, name)
    permute = cfg.architecture in ("llama", "mistral")
    layer_names = _GEMMA3_LAYER_NAMES if cfg.architecture == "gemma3" else _LAYER_NAMES
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = t.dequantize()  # writable, its own memory
        if t.name in _GLOBAL_NAMES:
            key = _GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".")  # blk.N.kind.(weight|bias)
            if parts[0] != "blk" or parts[2] not in layer_names:
                raise UnsupportedModelError(f"unexpected tensor {t.name!r} in {path}")
            if permute and parts[2] == "attn_q":
                w = _unpermute(w, cfg.num_heads)
            elif permute and parts[2] == "attn_k":
                w = _unpermute(w, cfg.num_kv_heads)
            key = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
        state[key] = torch.from_numpy(w)
    return cfg, state
