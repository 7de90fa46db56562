"""Read a Hugging Face model directory: config.json and *.safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from headwise.models.config import ModelConfig


def read_hf_config(path: Path, name: str) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    return ModelConfig.from_hf(json.loads(cfg_file.read_text()), name=name)


def load_hf_dir(path: Path, name: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = read_hf_config(path, name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weight files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if cfg.sandwich_norms:  # Gemma: the checkpoint holds w of x * (1 + w); headwise stores 1 + w
        state = {k: v.float() + 1 if k.endswith("norm.weight") else v for k, v in state.items()}
    return cfg, state
