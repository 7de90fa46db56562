"""Shared fixtures: tiny random-weight HF models of every supported architecture, saved
to temp directories, and the default model's tokenizer."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. Triton reads
# this when a kernel is defined, so it is set before any test imports the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# `make test` runs two pytest-xdist workers, one per core of the 2-core machines the suite
# is sized for: most tests are Python-bound and use one core anyway. One thread each keeps
# the matmul-bound ones from oversubscribing the cores (the C kernels follow torch's count).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]

# The longest test files, longest first (seconds of setup + calls each, summed from
# `pytest -n 2 --dist loadfile --durations=0` on a 2-core machine, 2026-12-03). `make test`
# hands whole files to its two workers in collection order (--no-loadscope-reorder), so
# the long ones start first and the short ones fill in at the end, instead of a long file
# starting last while the other worker idles (xdist's own order is by test count).
LONGEST_FIRST = ("test_gemma3.py",        # 231
                 "test_qwen.py",          # 201
                 "test_ray_serve.py",     # 191
                 "test_cuda_graphs.py",   # 107
                 "test_decode_capture.py",  # 96
                 "test_bench_harness.py",   # 88
                 "test_quality_suite.py",   # 69
                 "test_select_heads.py",    # 68
                 "test_calibration_eval.py",  # 66
                 "test_real_model.py",      # 61
                 "test_prefix_cache.py",    # 60
                 "test_kv_quant.py",        # 56
                 "test_disk_tier.py")       # 54


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer saved as HF files (it comes from the GGUF)."""
    from headwise.weights.loader import default_model_path
    from transformers import AutoTokenizer

    p = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    d = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(str(d))
    return d


def make_tiny_model(arch: str, directory: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Random-weight model of `arch` in HF format (config.json + safetensors + tokenizer)."""
    import shutil

    from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config,
                              Qwen3Config)

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    cfg = {
        "llama": lambda: LlamaConfig(**{"rope_theta": 10000.0, **common}),
        "mistral": lambda: MistralConfig(sliding_window=None, **{"rope_theta": 10000.0, **common}),
        "qwen2": lambda: Qwen2Config(**{"rope_theta": 10000.0, **common}),
        "qwen3": lambda: Qwen3Config(head_dim=32, **{"rope_theta": 10000.0, **common}),
        "gemma3": lambda: Gemma3TextConfig(**common),  # head_dim, windows and layer types in overrides
    }[arch]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, directory / f.name)
    return directory


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {a: make_tiny_model(a, root / a, tokenizer_dir) for a in ARCHS}


@pytest.fixture(scope="session")
def default_llm():
    """SmolLM2-135M-Instruct from the GGUF, all heads full (loaded once)."""
    from headwise import LLM

    return LLM(head_layout="full", kv_cache_memory=1 << 30, dtype="float32")


def assert_batched_equals_single(llm, prompts, params) -> None:
    """Generating prompts together gives each one what generating it alone gives."""
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, b in zip(prompts, batched):
        single = llm.generate(prompt, params, use_tqdm=False)[0]
        assert single.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(single.logprobs, b.logprobs)) < 1e-4
