import torch
import torch.nn.functional as F
from torch import nn

from headwise.kernels import pointwise


class RMSNorm(nn.Module):
    """x / rms(x) * weight. `upcast` (Gemma): computed in float32 and the weight kept in
    float32 (CausalLM.prepare_weights), as the reference does; Gemma's weight holds 1 + w."""

    def __init__(self, dim: int, eps: float, upcast: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.upcast = upcast
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        done = self._kernel(x)
        if done is not None:
            return done[1]
        return self._torch(x)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, its norm): a residual add and the norm after it, in one pass where the
        C kernel applies."""
        done = self._kernel(x, y)
        if done is not None:
            return done
        s = x + y
        return s, self._torch(s)

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # The C kernel rounds to x's dtype: what the PyTorch code returns when the weight
        # is in x's dtype or the norm is upcast (a float32 weight on 16-bit values).
        if not (self.upcast or self.weight.dtype == x.dtype):
            return None
        return pointwise.rms_norm(x, self.weight, self.eps, residual)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)
        # PyTorch's fused kernel accumulates in float32 for 16-bit inputs, as the reference
        # implementations do, and rounds once (they round before the weight multiply).
        # At [1024, 576] bfloat16 it is 4x faster than the float32 round trip spelled out.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
