"""The C kernels for RMSNorm and the rotary embedding (kernels/cpu_pointwise.c): they
compute what the PyTorch code computes (the rotary embedding bit for bit), on contiguous
and strided rows, and the layers fall back to PyTorch where the kernel does not apply."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from headwise.kernels import cpu_kernels, pointwise
from headwise.layers.norm import RMSNorm
from headwise.layers.rotary import RotaryEmbedding, rotate


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the layers keep PyTorch's code")
    assert cpu_kernels.pointwise_library() is not None, "a C compiler is here but the kernel did not build"


def _torch_rotate(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_rotary_is_pytorch_bit_for_bit(dtype, strided):
    torch.manual_seed(0)
    T, H, Hkv, D = 37, 9, 3, 64
    rot = RotaryEmbedding(D, 4096, 10000.0)
    cos, sin = rot.tables(torch.randint(0, 4096, (T,)))
    qkv = torch.randn(T, H + 2 * Hkv, D).to(dtype)
    x = qkv[:, :H] if strided else qkv[:, :H].contiguous()  # q of a fused projection: rows strided
    got = pointwise.rotate(x, cos, sin)
    assert got is not None and got.is_contiguous()
    assert torch.equal(got, _torch_rotate(x, cos, sin))
    assert torch.equal(rotate(x, cos, sin), got)
    # Tables turning positions back (negated sines, as back_tables gives) and one token.
    bc, bs = rot.back_tables(torch.arange(T))
    assert torch.equal(pointwise.rotate(x, bc, bs), _torch_rotate(x, bc, bs))
    assert torch.equal(pointwise.rotate(x[:1], cos[:1], sin[:1]), _torch_rotate(x[:1], cos[:1], sin[:1]))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_pytorch(dtype, tol):
    torch.manual_seed(1)
    x = (torch.randn(300, 576) * 3).to(dtype)
    w = torch.randn(576).to(dtype)
    s, got = pointwise.rms_norm(x, w, 1e-5)
    want = F.rms_norm(x, (576,), w, 1e-5)
    assert s is x and got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # Per-head norm (Qwen3, Gemma 3), rows of one stride that is not theirs, and a float32 weight on bfloat16
    # values (Gemma's upcast norm): computed in float32, rounded once.
    qkv = torch.randn(5, 15, 64).to(dtype)
    wf = torch.randn(64)
    contiguous = qkv[:, :9].contiguous()  # [5, 9, 64]: 45 rows
    got = pointwise.rms_norm(contiguous, wf, 1e-6)
    want = F.rms_norm(contiguous.float(), (64,), wf, 1e-6).to(dtype)
    torch.testing.assert_close(got[1].float(), want.float(), rtol=tol, atol=tol)
    got = pointwise.rms_norm(qkv[:, 2], wf, 1e-6)  # [5, 64], row stride 15 * 64
    want = F.rms_norm(qkv[:, 2].float(), (64,), wf, 1e-6).to(dtype)
    torch.testing.assert_close(got[1].float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_and_norm(dtype):
    torch.manual_seed(2)
    x, y = torch.randn(64, 128).to(dtype), torch.randn(64, 128).to(dtype)
    norm = RMSNorm(128, 1e-6)
    norm.weight.data = torch.randn(128).to(dtype)
    x0 = x.clone()
    s, h = norm.add(x, y)
    assert torch.equal(s, x + y) and torch.equal(x, x0)  # a new tensor, rounded as PyTorch adds
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(h.float(), F.rms_norm(x + y, (128,), norm.weight, 1e-6).float(), rtol=tol, atol=tol)


def test_where_the_kernel_does_not_apply_the_layers_use_pytorch():
    x = torch.randn(4, 3, 8, dtype=torch.float16)
    cos, sin = RotaryEmbedding(8, 16, 10000.0).tables(torch.arange(4))
    assert pointwise.rotate(x, cos, sin) is None  # float16: not taken
    assert torch.equal(rotate(x, cos, sin), _torch_rotate(x, cos, sin))
    norm = RMSNorm(8, 1e-6).to(torch.float16)
    assert pointwise.rms_norm(x, norm.weight, 1e-6) is None
    torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, 1e-6))
    xb = torch.randn(4, 8, dtype=torch.bfloat16)  # a float32 weight on bfloat16 values: PyTorch's promotion
    torch.testing.assert_close(RMSNorm(8, 1e-6)(xb), F.rms_norm(xb, (8,), torch.ones(8), 1e-6), rtol=0, atol=0)
    xt = torch.randn(4, 8, 3).transpose(1, 2)  # [4, 3, 8]: the norm's dim is not unit stride
    assert pointwise.rms_norm(xt, torch.ones(8), 1e-6) is None
    s, h = RMSNorm(8, 1e-6).add(xt, xt)
    torch.testing.assert_close(h, F.rms_norm(xt + xt, (8,), torch.ones(8), 1e-6))
    heads = torch.randn(5, 15, 64)[:, :9]  # [5, 9, 64] heads of a fused projection: no one row stride
    assert pointwise.rms_norm(heads, torch.ones(64), 1e-6) is None
    torch.testing.assert_close(RMSNorm(64, 1e-6)(heads), F.rms_norm(heads, (64,), torch.ones(64), 1e-6))
