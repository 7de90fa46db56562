"""The prepacked linear layer against plain F.linear, packed and not."""
import pytest
import torch
import torch.nn.functional as F

from headwise.layers.int4 import INT4_MAX_ROWS, torch_int4_rows
from headwise.layers.linear import Linear, activate, can_pack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 5, 33])
def test_packed_linear_matches_plain(dtype, bias, rows):
    if not can_pack(torch.zeros(1, dtype=dtype)):
        pytest.skip("oneDNN packing not available in this build")
    torch.manual_seed(rows)
    lin = Linear(24, 40, bias=bias).to(dtype)
    w = lin.weight.detach().clone()
    b = None if lin.bias is None else lin.bias.detach().clone()
    x = torch.randn(rows, 24, dtype=dtype)
    other = torch.randn(rows, 40, dtype=dtype)
    plain = (lin(x), lin(x, act="silu"), lin.times(x, other))
    assert lin.pack() and lin.weight is None and lin.packed is not None
    assert torch.equal(lin.dense_weight(), w)
    packed = (lin(x), lin(x, act="silu"), lin.times(x, other))
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    want = (ref, F.silu(ref), ref * other.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for p, q, r in zip(plain, packed, want):
        assert p.shape == q.shape == (rows, 40) and q.dtype == dtype
        if rows:
            assert (p.float() - r).abs().max().item() <= tol
            assert (q.float() - r).abs().max().item() <= tol


def test_pack_leaves_unsupported_weights_alone():
    lin = Linear(8, 4, bias=False).to(torch.float16)
    assert not lin.pack() and lin.packed is None and lin.weight is not None
    with pytest.raises(ValueError, match="unsupported activation"):
        lin(torch.zeros(1, 8, dtype=torch.float16), act="gelu")


@pytest.mark.parametrize("packable", [True, False])
def test_engine_packs_cpu_weights(tiny_models, monkeypatch, packable):
    """Where oneDNN packs weights, every projection is packed once and its dense copy
    dropped; where it cannot (patched off here), each keeps its dense weight and computes
    with it."""
    from headwise import LLM
    from headwise.layers import linear

    if not packable:
        monkeypatch.setattr(linear, "can_pack", lambda weight: False)
    elif not can_pack(torch.zeros(1)):
        pytest.skip("no oneDNN in this PyTorch build")
    llm = LLM(str(tiny_models["llama"]), head_layout="full", kv_cache_memory=1 << 22)
    lins = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert lins
    if packable:
        assert all(m.packed is not None and m.weight is None for m in lins)
    else:
        assert all(m.packed is None and m.weight is not None for m in lins)
        x = torch.randn(3, lins[0].in_features, dtype=lins[0].weight.dtype)
        assert torch.allclose(lins[0](x), F.linear(x, lins[0].weight, lins[0].bias))


def _q4_1_weight(N: int, K: int, seed: int = 0):
    """A weight as llama.cpp's Q4_1 stores it: per group of 32 inputs, codes 0..15 (the
    group's minimum coded 0, its maximum 15) with a float16 scale d and minimum m."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K // 32, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (torch.randn(N, K // 32, 1, generator=g) * 0.05).half().float()
    return (codes * d + m).view(N, K), codes.view(N, K), d.view(N, -1), m.view(N, -1)


def test_exact_int4_recovers_q4_1_and_rejects_other_weights():
    from headwise.layers.int4 import exact_int4

    w, codes, d, m = _q4_1_weight(32, 64)
    got = exact_int4(w)
    assert got is not None
    assert torch.equal(got[0], codes.to(torch.int32)) and torch.equal(got[2], m)
    assert torch.allclose(got[1], d, rtol=1e-6)
    assert exact_int4(torch.randn(32, 64)) is None            # not on a 16-level grid
    assert exact_int4(w.bfloat16()) is None                    # only float32 is exact
    assert exact_int4(_q4_1_weight(8, 64)[0]) is None          # the kernel needs N % 16 == 0
    off = w.clone()
    off[3, 5] += 1e-4                                          # one value off the grid
    assert exact_int4(off) is None


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_0"])
def test_exact_int4_recovers_groups_whose_codes_need_not_span_0_to_15(qtype):
    """Q4_K's sub-blocks (a scale and a minimum per 32 inputs) and Q4_0's blocks: a group's
    codes span fewer than 16 steps; recovered to float32 rounding, codes within 0..15."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from headwise.layers.int4 import exact_int4
    from tests.test_int8_matmul import kquant_weight

    if qtype == "Q4_K":
        w = kquant_weight(32, 512, Q.Q4_K)
    else:
        w = torch.from_numpy(dequantize(quantize(torch.randn(32, 512).numpy(), Q.Q4_0), Q.Q4_0).copy())
    codes, scale, low = exact_int4(w)
    assert codes.min() >= 0 and codes.max() <= 15
    back = (codes.view(32, 16, 32) * scale[..., None] + low[..., None]).view(32, 512)
    assert ((back - w).abs() <= 1e-6 * w.abs().max()).all()
    assert exact_int4(kquant_weight(32, 512, Q.Q6_K)) is None  # 64 levels
    assert exact_int4(kquant_weight(32, 512, Q.Q5_K)) is None  # 32 levels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_copy_serves_small_calls_only(dtype):
    w = _q4_1_weight(48, 64, seed=1)[0]
    lin = Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.normal_()
    b = lin.bias.detach().clone()
    assert lin.find_int4()
    lin.to(dtype)
    # Kept for bfloat16 activations only (the int4 kernel is ~10x slower with float32 ones).
    assert lin.pack() and (lin.int4 is not None) == (dtype == torch.bfloat16)
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    for rows in (1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 64).to(dtype)
        other = torch.randn(rows, 48).to(dtype)
        ref = F.linear(x.float(), w, b)
        assert (lin(x).float() - ref).abs().max().item() < tol
        assert (lin(x, act="silu").float() - F.silu(ref)).abs().max().item() < tol
        assert (lin.times(x, other).float() - ref * other.float()).abs().max().item() < 2 * tol
    if lin.int4 is None:
        return
    # Which calls read the 4-bit copy: spoil it, and only those of <= INT4_MAX_ROWS rows change.
    small, large = torch.randn(INT4_MAX_ROWS, 64).to(dtype), torch.randn(INT4_MAX_ROWS + 1, 64).to(dtype)
    before = lin(small), lin(large)
    lin.int4 = (lin.int4[0], torch.zeros_like(lin.int4[1]))
    assert not torch.equal(lin(small), before[0]) and torch.equal(lin(large), before[1])


@pytest.mark.parametrize("bias", [False, True])
def test_fused_int4_equals_its_parts(bias):
    from headwise.layers.linear import FusedInt4

    parts = [Linear(64, n, bias=bias) for n in (32, 16, 16)]
    with torch.no_grad():
        for i, p in enumerate(parts):
            p.weight.copy_(_q4_1_weight(p.out_features, 64, seed=i)[0])
    x = torch.randn(3, 64)
    want = []
    for p in parts:
        assert p.find_int4()
        want.append(p.int4_mm(x))
    fused = FusedInt4(parts)
    assert fused.applies(x) and not fused.applies(torch.randn(INT4_MAX_ROWS + 1, 64))
    # (float32 here, to compare exactly; the model keeps it for bfloat16 only, see cast)
    assert all(p.int4 is None for p in parts)  # one 4-bit copy, not two
    torch.testing.assert_close(fused(x), torch.cat(want, -1), rtol=1e-5, atol=1e-5)
    # A part that is not exactly 4-bit: nothing fused, the parts keep theirs.
    other = Linear(64, 16, bias=bias)
    assert FusedInt4([Linear(64, 16), other]).int4 is None
    # Cast for float32 activations: dropped (the parts run packed).
    fused.cast(torch.float32)
    assert fused.int4 is None and not fused.applies(x)


def test_default_model_decodes_with_its_4bit_weights(default_llm):
    """The shipped GGUF is Q4_1 for every projection (Q8_0 embedding, tied to the head): q/k/v
    and gate/up as one fused 4-bit matmul each, o and down on their own."""
    model = default_llm.engine.model
    # bfloat16 activations (the engine's choice on a CPU with AVX512-BF16) get the 4-bit
    # path; float32 ones run packed.
    four = default_llm.engine.dtype == torch.bfloat16
    for layer in model.model.layers:
        assert (layer.self_attn.qkv_int4.int4 is not None) == four == (layer.mlp.gate_up_int4.int4 is not None)
        assert (layer.self_attn.o_proj.int4 is not None) == four == (layer.mlp.down_proj.int4 is not None)
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                    layer.mlp.gate_proj, layer.mlp.up_proj):
            assert lin.int4 is None and lin.packed is not None  # prefill: packed dense
    assert model.lm_head.int4 is None



def _codes_only(N: int, K: int, bias: bool, seed: int) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    """A Q4_1 layer kept as its 4-bit codes alone (bfloat16), its float32 weight and bias."""
    w = _q4_1_weight(N, K, seed=seed)[0]
    lin = Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(w)
    b = lin.bias.detach().clone() if bias else None
    assert lin.find_int4()
    lin.to(torch.bfloat16)
    lin.keep_codes_only(torch.bfloat16)
    return lin, w, b


@pytest.mark.parametrize("bias", [False, True])
def test_codes_only_layer_serves_every_row_count(bias):
    """dense_weights=False (CausalLM.prepare_weights(dense=False)): no dense weight is kept,
    and every call, prefill-sized too, multiplies with the codes."""
    lin, w, b = _codes_only(128, 96, bias, seed=3)
    assert lin.codes_only and lin.weight is None and lin.packed is None
    for rows in (1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 40, 130):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        other = torch.randn(rows, 128).to(torch.bfloat16)
        ref = F.linear(x.float(), w, b)
        tol = 0.02 * ref.abs().max().item()  # bfloat16 scales and outputs
        assert (lin(x).float() - ref).abs().max().item() < tol, rows
        assert (lin(x, act="silu").float() - F.silu(ref)).abs().max().item() < tol, rows
        assert (lin.times(x, other).float() - ref * other.float()).abs().max().item() < 3 * tol, rows
    torch.testing.assert_close(lin.dense_weight().float(), w, atol=0.02 * w.abs().max().item(), rtol=0)
    # Leading dimensions are kept.
    x3 = torch.randn(2, 5, 96).to(torch.bfloat16)
    assert lin(x3).shape == (2, 5, 128)


def test_codes_only_falls_back_to_pytorchs_int4_kernel(monkeypatch):
    """Where kernels.codes_gemm declines (no AVX512-BF16, a torch.compile trace), calls of
    any size run PyTorch's int4 kernel on the same codes."""
    import headwise.layers.int4 as L

    lin, w, _ = _codes_only(64, 64, False, seed=4)
    x = torch.randn(50, 64).to(torch.bfloat16)
    with_kernel = lin(x)
    monkeypatch.setattr(L, "int4_gemm", lambda *a: None)
    without = lin(x)
    ref = F.linear(x.float(), w)
    for y in (with_kernel, without):
        assert (y.float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()


def test_keep_codes_only_needs_codes_and_bfloat16():
    lin = Linear(64, 32)
    with pytest.raises(ValueError, match="4-bit copy"):
        lin.keep_codes_only(torch.bfloat16)  # a float weight with no codes
    lin, _, _ = _codes_only(32, 64, False, seed=5)
    with pytest.raises(ValueError, match="4-bit copy"):
        Linear(64, 32).keep_codes_only(torch.float32)


def _int8_codes_only(group: int, lows: bool, bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    """A layer whose file stores int8 codes (Q6_K: a scale per 16 inputs; Q5_K: codes
    0..31, a scale and a minimum per 32), loaded lazily (no dense weight) and kept as its
    codes alone; the bfloat16 weight they stand for, and the bias."""
    from headwise.layers.quant import QuantCodes

    g = torch.Generator().manual_seed(group + lows)
    N, K = 128, 96
    codes = (torch.randint(0, 32, (N, K), generator=g) if lows else torch.randint(-32, 32, (N, K), generator=g))
    scales = torch.rand(N, K // group, generator=g) * 0.02 + 1e-3
    q = QuantCodes(codes.to(torch.int8), scales, -torch.rand(N, K // group, generator=g) * 0.3 if lows else None,
                   group, 32 if lows else 64)
    lin = Linear(K, N, bias=bias)
    lin.weight, lin.quant = None, q
    assert not lin.find_int4() and lin.find_int8()
    lin.keep_codes_only(torch.bfloat16)  # the bias cast, the scales kept float32
    b = lin.bias.detach().clone() if bias else None
    return lin, q.dense(torch.bfloat16).float(), b


@pytest.mark.parametrize("group,lows,bias", [(16, False, True), (32, True, False)])
def test_int8_codes_only_layer_serves_every_row_count(group, lows, bias):
    """A weight with int8 codes and no 4-bit ones (Q6_K, Q8_0, Q5_K) kept as its codes
    alone: the int8 kernel up to 4 rows, the tile matmul above, in eager calls and in a
    compiled graph (an opaque op), with a bias, an activation and a product."""
    from headwise.kernels.codes_gemm import int8_gemm
    from headwise.layers import opaque

    if int8_gemm(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.int8),
                 torch.ones(64, 1)) is None:
        pytest.skip("no AVX512-BF16 matmul over int8 codes on this machine")
    lin, w, b = _int8_codes_only(group, lows, bias)
    assert lin.codes_only and lin.weight is None and lin.packed is None and lin.quant is None
    assert torch.equal(lin.dense_weight().float(), w)  # the tile's weight, exactly
    opaque.register(lin)
    compiled = torch.compile(lambda x: lin(x, act="silu"), backend="eager", fullgraph=True)
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        other = torch.randn(rows, 128).to(torch.bfloat16)
        ref = F.linear(x.float(), w, None if b is None else b.float())
        tol = 0.01 * ref.abs().max().item()  # bfloat16 outputs
        assert (lin(x).float() - ref).abs().max().item() < tol, rows
        assert (compiled(x).float() - F.silu(ref)).abs().max().item() < tol, rows
        assert (lin.times(x, other).float() - ref * other.float()).abs().max().item() < 3 * tol, rows
    assert lin(torch.randn(2, 5, 96).to(torch.bfloat16)).shape == (2, 5, 128)


def test_int8_codes_only_multiplies_a_dense_weight_where_the_kernels_decline(monkeypatch):
    """Where the tile matmul declines (a machine without it, activations it does not take)
    the call still answers, from the weight made dense for it."""
    import headwise.layers.linear as L

    if L.int8_gemm(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.int8),
                   torch.ones(64, 1)) is None:
        pytest.skip("no AVX512-BF16 matmul over int8 codes on this machine")
    lin, w, b = _int8_codes_only(16, False, True)
    monkeypatch.setattr(L, "int8_gemm", lambda *a: None)
    x = torch.randn(9, 96)
    ref = F.linear(x, w, b.float())
    assert (lin(x.to(torch.bfloat16)).float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()


def test_fused_int4_kept_as_codes_only_serves_prefill():
    from headwise.layers.linear import FusedInt4

    parts = [Linear(64, n, bias=True) for n in (64, 32, 32)]
    with torch.no_grad():
        for i, p in enumerate(parts):
            p.weight.copy_(_q4_1_weight(p.out_features, 64, seed=10 + i)[0])
    ws = [p.weight.detach().clone() for p in parts]
    bs = [p.bias.detach().clone() for p in parts]
    fused = FusedInt4(parts)
    fused.cast(torch.bfloat16)
    big = torch.randn(INT4_MAX_ROWS + 7, 64).to(torch.bfloat16)
    assert not fused.codes_only and not fused.applies(big)  # the parts still have their weights
    fused.keep_codes_only()
    assert fused.codes_only and fused.applies(big)
    assert all(p.weight is None and p.packed is None for p in parts)
    ref = F.linear(big.float(), torch.cat(ws), torch.cat(bs))
    assert (fused(big).float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()
    assert {n for n, _ in fused.named_modules()} == {""}  # the parts are not its submodules


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gate_and_up_kept_as_codes_only_run_as_one_gated_product(act, monkeypatch):
    """An MLP's gate and up kept as codes only (a 4-bit fusion, or two int8 weights):
    above decode size, act(gate(x)) * up(x) comes from one kernel call
    (kernels.codes_gemm's gated products), within bfloat16 rounding of the two matmuls
    and the activation run apart; at decode size, and where the kernel declines, the
    caller's path (None)."""
    import headwise.layers.linear as L
    from headwise.layers.linear import FusedInt4, int8_glu

    parts = [Linear(64, 128, bias=False) for _ in range(2)]
    with torch.no_grad():
        for i, p in enumerate(parts):
            p.weight.copy_(_q4_1_weight(128, 64, seed=20 + i)[0])
    fused = FusedInt4(parts)
    fused.cast(torch.bfloat16)
    x = torch.randn(INT4_MAX_ROWS + 9, 64).to(torch.bfloat16)
    assert fused.glu(x, act) is None  # the parts still have their weights
    fused.keep_codes_only()
    gate, up = fused(x).float().split(fused.sizes, dim=-1)
    apart = activate(gate, act) * up
    one = fused.glu(x, act)
    if one is None:
        pytest.skip("no AVX512-BF16 gated product on this machine")
    assert one.shape == (x.shape[0], 128)
    assert (one.float() - apart).abs().max().item() < 0.02 * apart.abs().max().item()
    # decode size (PyTorch's int4 kernel, up to torch_int4_rows(): 4 with AMX, else 8): apart
    assert fused.glu(x[:torch_int4_rows()], act) is None
    if torch_int4_rows() < INT4_MAX_ROWS:  # 5-8 rows with AMX: codes_gemm's, as one gated call
        assert fused.glu(x[:INT4_MAX_ROWS], act) is not None
    gate8, _, _ = _int8_codes_only(16, False, False)
    up8, _, _ = _int8_codes_only(32, True, False)
    y = torch.randn(9, 96).to(torch.bfloat16)
    assert int8_glu(gate8, up8, y, act) is None  # groups of 16 and 32: two calls
    up8, _, _ = _int8_codes_only(16, False, False)
    with torch.no_grad():
        up8.int8_codes.copy_(torch.roll(up8.int8_codes, 1, 0))  # another weight of the same form
    apart = activate(gate8(y).float(), act) * up8(y).float()
    one = int8_glu(gate8, up8, y, act)
    assert one.shape == (9, 128)
    assert (one.float() - apart).abs().max().item() < 0.02 * apart.abs().max().item()
    assert int8_glu(gate8, up8, y[:4], act) is None  # kernels.int8_matmul's rows
    monkeypatch.setattr(L, "int8_gemm_glu", lambda *a: None)
    assert int8_glu(gate8, up8, y, act) is None
