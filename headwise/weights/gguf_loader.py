"""Read a GGUF file: model config from its metadata, weights as float32 tensors with HF
parameter names, and, for the block formats weights.gguf_codes reads, their codes and
scales (the decode copies are taken from those; the dense weights are computed from
them)."""
from __future__ import annotations

from pathlib import Path

import torch

from headwise.models.config import (GEMMA3_LOCAL_ROPE_THETA, SUPPORTED_ARCHITECTURES, ModelConfig,
                                    UnsupportedModelError, gemma3_layer_types)
from headwise.layers.quant import QuantCodes
from headwise.weights.gguf_codes import read_codes
from headwise.weights.gguf_file import DEQUANT_THREADS, GGUFFile

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


def _unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's converter, which interleaves the two rotary
    halves of each Llama/Mistral q/k head (the rotary here is half-split): row r of the
    result is row index[r] of the file's tensor."""
    return torch.arange(rows).view(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


def load_gguf(path: Path, name: str, dense: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor],
                                                                  dict[str, QuantCodes]]:
    """(config, float32 state dict, codes of the weights stored in a block format
    weights.gguf_codes reads, by the same names). dense=False: those weights are left out
    of the state dict (their codes say it all: layers.quant)."""
    reader = GGUFFile(path)
    cfg = read_config(reader, name)
    permute = cfg.architecture in ("llama", "mistral")
    layer_names = _GEMMA3_LAYER_NAMES if cfg.architecture == "gemma3" else _LAYER_NAMES
    state: dict[str, torch.Tensor] = {}
    codes: dict[str, QuantCodes] = {}
    for t in reader.tensors:
        heads = None
        if t.name in _GLOBAL_NAMES:
            key = _GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".")  # blk.N.kind.(weight|bias)
            if parts[0] != "blk" or parts[2] not in layer_names:
                raise UnsupportedModelError(f"unexpected tensor {t.name!r} in {path}")
            if permute and parts[2] in ("attn_q", "attn_k"):
                heads = cfg.num_heads if parts[2] == "attn_q" else cfg.num_kv_heads
            key = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
        found = read_codes(t.data, t.qtype, DEQUANT_THREADS) if len(t.shape) == 2 else None
        if found is not None:
            if heads is not None:
                found = found.take_rows(_unpermute_index(found.shape[0], heads))
            codes[key] = found
            if dense:
                state[key] = found.dense()
        else:
            w = torch.from_numpy(t.dequantize())  # writable, its own memory
            state[key] = w if heads is None else w[_unpermute_index(w.shape[0], heads)]
        reader.release(t)  # copied out: its pages of the file need not stay resident
    return cfg, state, codes
