import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # PyTorch's fused kernel accumulates in float32 for 16-bit inputs, as the reference
        # implementations do, and rounds once (they round before the weight multiply).
        # At [1024, 576] bfloat16 it is 4x faster than the float32 round trip spelled out.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
