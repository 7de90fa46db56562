"""Modules that a compiled graph calls as opaque custom ops (engine.decode_capture).

The graph passes the module's key as a tensor, its `op_key` buffer, and the op looks the
module up at run time. A key baked into the graph as a constant would be shared by cached
graphs of other engines in the process; a buffer is an input, read anew on every call.
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

_MODULES: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register(module: nn.Module) -> None:
    """Give `module` a key (its op_key buffer, on the CPU) that `lookup` resolves."""
    key = next(_KEYS)
    _MODULES[key] = module
    module.register_buffer("op_key", torch.tensor(key), persistent=False)


def lookup(key: torch.Tensor) -> nn.Module:
    return _MODULES[int(key)]
