"""Model loading: a GGUF file or a HF directory -> (CausalLM, Tokenizer)."""
from __future__ import annotations

import ctypes
import gc
import json
from pathlib import Path

import torch

from headwise.models.config import ModelConfig, UnsupportedModelError
from headwise.models.causal_lm import CausalLM
from headwise.tokenizer import Tokenizer
from headwise.weights.gguf_file import GGUFFile
from headwise.weights.gguf_loader import load_gguf, read_config
from headwise.weights.hf_loader import load_hf_dir, read_hf_config
from headwise.weights.registry import (DEFAULT_MODEL_NAME, KNOWN_FILES, KNOWN_MODELS, cache_dir,
                                       default_model_path, known_model_path)


def resolve_model_path(model: str | None) -> Path:
    """None: the default model; an existing path; else a known name (weights.registry)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        path = known_model_path(model) or path
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist; known model names: "
                                f"{DEFAULT_MODEL_NAME}, {', '.join(n for n in KNOWN_MODELS if n != DEFAULT_MODEL_NAME.lower())}")
    return path


def model_name(path: Path) -> str:
    return KNOWN_FILES.get(path.name) or (path.stem if path.is_file() else path.name)


def model_identity(model: str | None) -> str:
    """Names the weights: resolved path, and each file's size and modification time."""
    path = resolve_model_path(model).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return json.dumps([str(path)] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files])


def checkpoint_dtype(model: str | None) -> str | None:
    """The dtype a HF checkpoint was saved in (config.json), None for GGUF (quantized)."""
    path = resolve_model_path(model)
    if path.is_file():
        return None
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None  # load_model reports a missing or broken config
    return cfg.get("torch_dtype") or cfg.get("dtype")


def read_model_config(model: str | None) -> ModelConfig:
    """The model's config without loading its weights."""
    path = resolve_model_path(model)
    return read_config(GGUFFile(path), model_name(path)) if path.is_file() else \
        read_hf_config(path, model_name(path))


# GGUF architectures and the tokenizer type transformers' AutoTokenizer picks for them.
# Named, AutoTokenizer goes straight to that tokenizer class; unnamed, it first builds the
# model's whole config from the file with the gguf package's reader, which walks every
# vocabulary and merge string in Python (23 of the 31 s a first load of Qwen2.5-Coder-1.5B's
# tokenizer took here). An architecture is named here once a test shows both ways build
# the same tokenizer (tests/test_qwen.py, tests/test_gemma3.py: 18.9 s -> 3.2 s for Gemma 3's
# 262K tokens here); others take AutoTokenizer's own way. Llama has no type of its own
# there (its GGUF tokenizers differ by model): SmolLM2 keeps the config pass (4 s, cached).
TOKENIZER_TYPES = {"qwen2": "qwen2", "gemma3": "gemma3"}


def load_tokenizer(model: str | None) -> Tokenizer:
    """The model's tokenizer alone: from a GGUF's metadata (cached per file) or a HF directory."""
    path = resolve_model_path(model)
    if path.is_file():
        kind = TOKENIZER_TYPES.get(GGUFFile(path).get("general.architecture"))
        return Tokenizer.from_path(path.parent, gguf_file=path.name, cache=cache_dir(), tokenizer_type=kind)
    return Tokenizer.from_path(path)


def load_model(model: str | None, dtype: torch.dtype, device: torch.device | str = "cpu",
               lazy: bool = False) -> tuple[CausalLM, Tokenizer]:
    """The model (load_weights) and its tokenizer."""
    return load_weights(model, dtype, device, lazy), load_tokenizer(model)


def load_weights(model: str | None, dtype: torch.dtype, device: torch.device | str = "cpu",
                 lazy: bool = False) -> CausalLM:
    """The model with its weights. lazy (CPU only): a GGUF's block-format weights stay
    their codes (`quant` of their Linear or Embedding, weight None) until
    CausalLM.prepare_weights makes each dense in the compute dtype, so the whole model is
    never held in float32 (Qwen2.5-Coder-1.5B: 6.2 GB); such a model runs only prepared."""
    path = resolve_model_path(model)
    name = model_name(path)
    lazy = lazy and torch.device(device).type == "cpu"
    if path.is_file():
        if path.suffix != ".gguf":
            raise UnsupportedModelError(f"{path} is neither a .gguf file nor a model directory")
        cfg, state, codes = load_gguf(path, name, dense=not lazy)
    else:
        (cfg, state), codes = load_hf_dir(path, name), {}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model_ = CausalLM(cfg)
    # Every tensor comes from `state` (assigned, not copied); none is allocated first.
    missing, unexpected = model_.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")
               and m not in codes]
    if missing or unexpected:
        raise UnsupportedModelError(
            f"weights of {path} do not match a {cfg.architecture} model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for key, quant in codes.items():  # the decode copies are taken from these (layers.quant)
        module = model_.get_submodule(key.rsplit(".", 1)[0])
        if not (key.endswith(".weight") and hasattr(module, "quant")):
            raise UnsupportedModelError(f"{path}: {key} is quantized but not a projection or embedding weight")
        module.quant = quant
        if key not in state:  # lazy: no dense weight until prepare_weights
            module.weight = None
    if cfg.tie_word_embeddings:
        model_.lm_head.weight = model_.model.embed_tokens.weight
        model_.lm_head.quant = model_.model.embed_tokens.quant
    if any(t.is_meta for t in list(model_.parameters()) + list(model_.buffers())):
        raise UnsupportedModelError(f"weights of {path} leave some of a {cfg.architecture} model's tensors unset")
    model_.model.build_rotary(cfg, device)
    return model_.to(dtype=dtype, device=device).eval()


def release_freed_heap() -> bool:
    """Hand the heap pages that loading freed (the float32 state dict and pre-cast
    weights) back to the OS. glibc keeps them mapped otherwise, and since the KV pools are
    allocated next, in fresh pages, they stay in the resident size for good (an engine on
    SmolLM2 with a 1 GiB KV pool: 1.85 GB resident instead of 2.02, measured). False where
    the C library has no malloc_trim (not glibc)."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_heap(mmap_threshold: int = 64 << 20, trim_threshold: int = 512 << 20) -> bool:
    """Let glibc recycle the memory of a step's temporary tensors instead of mapping
    fresh pages for each one. By default an allocation of a few MiB (a dequantized
    sequence of int8 KV, a gathered ring) may get new pages from the OS, and their page
    faults cost more than the work on them: dequantizing one 8K-token head took 596 us
    that way against 75 us on recycled memory (this machine). Allocations below
    `mmap_threshold` come from the heap, and freed heap memory is kept up to
    `trim_threshold`. Call after release_freed_heap. False where the C library has no
    mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
