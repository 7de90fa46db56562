"""The matmuls over 4-bit and int8 codes of any row count (kernels/codes_gemm.py,
kernels/cpu_gemm.c): each computes x times the weight the codes stand for, to the
precision of its bfloat16 output, for row counts around its 6-row tiles and K not a
multiple of its 1024-input tiles; the 4-bit one reads the codes where PyTorch's own int4
kernel does, the int8 one the dense weight layers.quant makes from the same codes; both
decline what they do not take; the gated products (an MLP's act(gate(x)) * up(x) in one
call) are within the same rounding of their float64 value. Every test runs with
AVX512-BF16 dot products and, on a CPU with AMX, again with AMX tiles."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headwise.kernels.codes_gemm import (available, gemm_amx, int4_gemm, int4_gemm_glu, int8_gemm, int8_gemm_glu,
                                         int8_gemm_takes)
from headwise.layers.int4 import int4_cast, int4_pack
from headwise.layers.quant import QuantCodes

pytestmark = pytest.mark.skipif(not available(), reason="no AVX512-BF16 kernel on this machine")


@pytest.fixture(params=["vector", "amx"], autouse=True)
def multiply_with(request):
    """Each test once per way the kernels multiply: AVX512-BF16 dot products, AMX tiles."""
    amx = gemm_amx()
    if request.param == "amx" and not amx:
        pytest.skip("no AMX on this machine (or Linux did not grant its state)")
    gemm_amx(request.param == "amx")
    assert gemm_amx() == (request.param == "amx")
    yield
    gemm_amx(amx)


def weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random 4-bit codes [n, k] with a scale and a minimum per 32 inputs (as GGUF's Q4_1,
    Q4_K), packed: (codes, sz) in the int4 kernel's form, and the bfloat16 weight they
    stand for, computed in float64 from the bfloat16 scales and offsets: (code - 8) *
    scale + offset, rounded once to float32 (the kernel's fused multiply-add), then to
    bfloat16."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    low = -torch.rand(n, k // 32, generator=g) * 0.16
    packed, sz = int4_cast(int4_pack(codes, scale, low), torch.bfloat16)
    s, o = (sz[..., i].double().t().repeat_interleave(32, dim=1) for i in (0, 1))  # [n, k]
    w = ((codes.double() - 8) * s + o).float().to(torch.bfloat16)
    return packed, sz, w


@pytest.mark.parametrize("n,k", [(64, 32), (192, 576), (128, 1056)])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 64, 200])
def test_product_of_the_bfloat16_weight(n, k, m):
    packed, sz, w = weight(n, k, seed=n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    y = int4_gemm(x, packed, sz)
    exact = x.double() @ w.double().t()
    # one rounding to bfloat16 (half a unit: 2^-8 relative), float32 accumulation well
    # inside 2^-16 of the sum of magnitudes (a misread code or scale is far outside)
    bound = exact.abs() * 2 ** -8 + (x.double().abs() @ w.double().abs().t()) * 2 ** -16
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert ((y.double() - exact).abs() <= bound).all()


def test_reads_the_codes_where_pytorchs_int4_kernel_does():
    """Against PyTorch's own int4 matmul (float32 weights, so only bfloat16-sized gaps)."""
    packed, sz, _ = weight(256, 512, seed=1)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ref = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz).double()
    y = int4_gemm(x, packed, sz).double()
    assert (y - ref).abs().max() <= 0.02 * ref.abs().max()


def test_strided_rows_and_threads():
    packed, sz, w = weight(128, 256, seed=3)
    base = torch.randn(40, 300, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x = base[:, 10:266]  # row stride 300
    one = int4_gemm(x.contiguous(), packed, sz)
    assert torch.equal(int4_gemm(x, packed, sz), one)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(int4_gemm(x, packed, sz), one)  # each output's sum in one order
    finally:
        torch.set_num_threads(threads)


def test_declines_what_it_does_not_take():
    packed, sz, _ = weight(64, 64, seed=5)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert int4_gemm(x.float(), packed, sz) is None              # float32 activations
    assert int4_gemm(x[:, :32], packed, sz) is None               # K of another weight
    assert int4_gemm(x.t().contiguous().t(), packed, sz) is None  # inner stride 3
    p48, sz48, _ = weight(48, 64, seed=6)                         # a last block of 48 rows
    assert int4_gemm(x, p48, sz48) is None


def int8_weight(n: int, k: int, group: int, lows: bool, seed: int) -> QuantCodes:
    """Random int8 codes [n, k] with a float32 scale (and minimum) per `group` inputs: a
    GGUF Q8_0 or Q6_K weight (signed codes), or Q5_K's (codes 0..31 and a minimum)."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randint(0, 32, (n, k), generator=g) if lows
             else torch.randint(-127, 128, (n, k), generator=g)).to(torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    low = -torch.rand(n, k // group, generator=g) * 0.3 if lows else None
    return QuantCodes(codes, scales, low, group, 32 if lows else 256)


def bounded(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """y within one bfloat16 rounding plus float32 accumulation of x @ w.T (see
    test_product_of_the_bfloat16_weight)."""
    exact = x.double() @ w.double().t()
    bound = exact.abs() * 2 ** -8 + (x.double().abs() @ w.double().abs().t()) * 2 ** -16
    return y.dtype == torch.bfloat16 and y.shape == exact.shape and bool(((y.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("group,lows", [(32, False), (16, False), (32, True), (16, True)])
@pytest.mark.parametrize("n,k,m", [(64, 32, 1), (192, 576, 7), (128, 1056, 13), (64, 2080, 200)])
def test_int8_product_of_the_dense_weight(group, lows, n, k, m):
    """Against the bfloat16 weight layers.quant makes from the same codes (the dense copy
    a model would otherwise keep): the tile holds that weight exactly, so only the
    product's rounding differs."""
    q = int8_weight(n, k, group, lows, seed=n + k + m + group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    y = int8_gemm(x, q.codes, q.scales, q.lows)
    assert bounded(y, x, q.dense(torch.bfloat16))


def test_int8_tile_is_the_dense_weight_bit_for_bit():
    """x = I reads the tile's weight back: every weight, transposed in registers, lands
    where the dense one has it, rounded as it is (one-hot rows: each sum has one term)."""
    for group, lows in ((16, False), (32, True)):
        q = int8_weight(128, 96, group, lows, seed=7)
        eye = torch.eye(96, dtype=torch.bfloat16)
        assert torch.equal(int8_gemm(eye, q.codes, q.scales, q.lows).t(), q.dense(torch.bfloat16))


def test_int8_strided_rows_threads_and_what_it_declines():
    q = int8_weight(128, 256, 16, False, seed=8)
    base = torch.randn(40, 300, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x = base[:, 10:266]  # row stride 300
    one = int8_gemm(x.contiguous(), q.codes, q.scales)
    assert torch.equal(int8_gemm(x, q.codes, q.scales), one)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(int8_gemm(x, q.codes, q.scales), one)
    finally:
        torch.set_num_threads(threads)
    assert int8_gemm(x.float(), q.codes, q.scales) is None               # float32 activations
    assert int8_gemm(x[:, :128], q.codes, q.scales) is None              # K of another weight
    assert int8_gemm(x, q.codes[:96], q.scales[:96]) is None             # a last block of 32 rows
    assert int8_gemm(x, q.codes, q.scales[:, :4]) is None                # 64 inputs per scale
    assert int8_gemm_takes(q.codes, q.scales, None)
    assert not int8_gemm_takes(q.codes[:96], q.scales[:96], None)


@pytest.mark.parametrize("n,m", [(192, 30), (192, 1100), (128, 1021)])
def test_rows_split_into_runs_sum_as_one(n, m):
    """Long calls are cut into runs of rows (and, on a weight of few 64-row blocks, into
    a multiple of the threads): every output is the same as one thread's (whose runs are
    cut by length only), and the product stays within its bound."""
    packed, sz, w = weight(n, 64, seed=m)
    q = int8_weight(n, 64, 32, False, seed=m)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ys = int4_gemm(x, packed, sz), int8_gemm(x, q.codes, q.scales)
        torch.set_num_threads(1)
        assert torch.equal(ys[0], int4_gemm(x, packed, sz)) and torch.equal(ys[1], int8_gemm(x, q.codes, q.scales))
    finally:
        torch.set_num_threads(threads)
    assert bounded(ys[0], x, w) and bounded(ys[1], x, q.dense(torch.bfloat16))


def gated_bounded(y: torch.Tensor, x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, act: str) -> bool:
    """y within act(x wg^T) * (x wu^T)'s bfloat16 rounding, plus each product's float32
    accumulation (as bounded()) carried through the activation (slope below 1.2) and the
    product, plus the activation's own float32 error."""
    xd = x.double()
    g, u = xd @ wg.double().t(), xd @ wu.double().t()
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    exact = a * u
    eg = (xd.abs() @ wg.double().abs().t()) * 2 ** -16
    eu = (xd.abs() @ wu.double().abs().t()) * 2 ** -16
    bound = exact.abs() * 2 ** -8 + 1.2 * eg * u.abs() + a.abs() * eu + exact.abs() * 1e-5 + 1e-30
    return y.dtype == torch.bfloat16 and y.shape == exact.shape and bool(((y.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 7, 17, 200])
def test_gated_products(act, m):
    """int4_gemm_glu over a fused gate/up weight (gate's rows first) and int8_gemm_glu over
    two int8 weights: act(gate) * up, rounded once; large |gate| too (the activation's
    exponential clamped, not overflowing)."""
    packed, sz, w = weight(256, 576, seed=m)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    x[0, :8] = 60.0  # gate outputs far from 0 on both sides
    assert gated_bounded(int4_gemm_glu(x, packed, sz, act), x, w[:128], w[128:], act)
    for group, lows in ((16, False), (32, True)):
        gate, up = int8_weight(128, 576, group, lows, seed=m), int8_weight(128, 576, group, lows, seed=m + 1)
        y = int8_gemm_glu(x, (gate.codes, gate.scales, gate.lows), (up.codes, up.scales, up.lows), act)
        assert gated_bounded(y, x, gate.dense(torch.bfloat16), up.dense(torch.bfloat16), act)


def test_gated_products_decline_what_they_do_not_take():
    packed, sz, _ = weight(256, 64, seed=9)
    x = torch.randn(20, 64).to(torch.bfloat16)
    assert int4_gemm_glu(x, packed, sz, "relu") is None                  # an activation it lacks
    p192, sz192, _ = weight(192, 64, seed=10)                             # gate and up of 96 rows
    assert int4_gemm_glu(x, p192, sz192, "silu") is None
    assert int4_gemm_glu(x.float(), packed, sz, "silu") is None          # float32 activations
    gate, up = int8_weight(128, 64, 32, False, seed=11), int8_weight(128, 64, 32, True, seed=12)
    assert int8_gemm_glu(x, (gate.codes, gate.scales, None), (up.codes, up.scales, up.lows), "silu") is None
    assert int8_gemm_glu(x, (gate.codes, gate.scales, None), (up.codes[:64], up.scales[:64], None), "silu") is None
    assert int8_gemm_glu(x, (gate.codes, gate.scales, None), (up.codes, up.scales, None), "tanh") is None
