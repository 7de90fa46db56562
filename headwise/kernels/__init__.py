"""Triton kernels for the two head classes (GPU path).

Import `headwise.kernels.triton_attention` only when the Triton backend is selected:
Triton reads TRITON_INTERPRET when a kernel is defined, so CPU tests set it first.
"""
from __future__ import annotations

import importlib.util
import os

import torch


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device) -> bool:
    """Kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter."""
    if not triton_installed():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def fix_interpreter_for_numpy() -> None:
    """Triton <= 3.6's interpreter turns 1-element arrays into Python ints with int(array),
    which NumPy >= 2.4 rejects (triton-lang/triton#9171, fixed upstream after 3.6). Wrap
    its tensor patching so __index__ reads the element explicitly. No-op when compiling."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "headwise_fixed", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.headwise_fixed = True
    interpreter._patch_lang_tensor = patched
