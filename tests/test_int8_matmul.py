"""The int8 copies of exactly-int8 weights (kernels/int8_matmul.py, kernels/cpu_matmul.c):
GGUF's symmetric block formats (scales per 32 or, for the K formats, per 16 inputs) are
recognised exactly, its 5-bit formats with a minimum per 32 inputs to float32 rounding,
and nothing else is; the kernel computes the dequantized weight's product, and layers use
it for calls of a few rows only."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from headwise.kernels import cpu_kernels, int8_matmul as K
from headwise.layers.linear import Linear
from tests.test_linear import _q4_1_weight


def gguf_weight(n: int, k: int, qtype: Q, seed: int = 0) -> torch.Tensor:
    """A float32 weight [n, k] as llama.cpp's quantizer leaves it (quantized, dequantized)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(dequantize(quantize(w, qtype), qtype)))


def kquant_weight(n: int, k: int, qtype: Q, seed: int = 0) -> torch.Tensor:
    """A float32 weight [n, k] as GGUF dequantizes random blocks of a K format (gguf has no
    quantizer for them): random codes and sub-block scales, float16 super-block scales
    of a realistic size."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    # the float16 fields: d and dmin first (Q4_K, Q5_K) or d last (Q3_K, Q6_K)
    at = [0, 2] if qtype in (Q.Q4_K, Q.Q5_K) else [size - 2]
    for a in at:
        raw[:, a:a + 2] = (rng.random(len(raw)) * 1e-3 + 1e-5).astype(np.float16).view(np.uint8).reshape(-1, 2)
    w = dequantize(raw.reshape(n, -1), qtype)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


@pytest.fixture(scope="module")
def compiled():
    if cpu_kernels.matmul_library() is None:
        pytest.skip("no C compiler: the int8 kernel is not built")


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_0])
def test_gguf_symmetric_blocks_are_exact_int8(qtype):
    w = gguf_weight(48, 256, qtype)
    w[3, 32:64] = 0  # an all-zero group
    codes, scales = K.exact_int8(w)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (48, 8)
    assert torch.equal((codes.view(48, 8, 32).float() * scales[..., None]).view(48, 256), w)


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q3_K])
def test_gguf_k_formats_with_a_scale_per_16_are_exact_int8(qtype):
    w = kquant_weight(32, 512, qtype)
    codes, scales = K.exact_int8(w)
    assert scales.shape == (32, 32)  # a scale per 16 inputs
    assert torch.equal((codes.view(32, 32, 16).float() * scales[..., None]).view(32, 512), w)


def test_other_weights_are_not_int8():
    assert K.exact_int8(kquant_weight(32, 256, Q.Q4_K)) is None  # a minimum per sub-block
    assert K.exact_int8(kquant_weight(32, 256, Q.Q5_K)) is None
    assert K.exact_int8(torch.randn(32, 64)) is None  # a float weight
    assert K.exact_int8(gguf_weight(32, 64, Q.Q4_1)) is None  # asymmetric blocks (4-bit copies take them)
    assert K.exact_int8(gguf_weight(32, 64, Q.Q8_0).bfloat16()) is None  # only while float32
    assert K.exact_int8(torch.zeros(4, 48)) is None  # not whole groups of 32
    w = gguf_weight(K.ROWS_AT_ONCE + 16, 32, Q.Q8_0)
    w[-1, 5] += 1e-3  # one value off the grid, in the last batch of rows
    assert K.exact_int8(w) is None


def affine_weight(qtype: Q, n: int = 32, k: int = 512, seed: int = 0) -> torch.Tensor:
    """Q5_1 through gguf's own quantizer, Q5_K as random blocks (gguf has no K quantizer)."""
    if qtype == Q.Q5_K:
        return kquant_weight(n, k, qtype, seed)
    return gguf_weight(n, k, qtype, seed)


@pytest.mark.parametrize("qtype", [Q.Q5_1, Q.Q5_K])
def test_5_bit_formats_with_a_minimum_get_an_int8_copy(qtype):
    w = affine_weight(qtype)
    assert K.exact_int8(w) is None  # not symmetric
    codes, scales, lows = K.int8_copy(w)
    assert codes.dtype == torch.int8 and codes.min() >= 0 and codes.max() <= 31
    back = (codes.view(32, 16, 32).float() * scales[..., None] + lows[..., None]).view(32, 512)
    assert ((back - w).abs() <= 1e-6 * w.abs().max()).all()
    assert K.int8_copy(torch.randn(32, 512)) is None
    assert K.int8_copy(kquant_weight(32, 512, Q.Q6_K))[2] is None  # symmetric: no minimums


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_kernel_matches_the_dequantized_weight(compiled, dtype, tol, rows):
    w = gguf_weight(200, 640, Q.Q8_0)  # 200 output rows: not a multiple of the kernel's chunk
    codes, scales = K.exact_int8(w)
    x = torch.randn(rows, 704)[:, 32:672].to(dtype)  # rows with a foreign stride
    y = K.int8_matmul(x, codes, scales)
    ref = x.float() @ w.T
    assert y.dtype == dtype and y.shape == (rows, 200)
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_kernel_with_a_scale_per_16_inputs(compiled, dtype, tol):
    w = kquant_weight(80, 512, Q.Q6_K, seed=1)
    codes, scales = K.exact_int8(w)
    x = torch.randn(3, 512).to(dtype)
    y = K.int8_matmul(x, codes, scales)
    ref = x.float() @ w.T
    assert y.dtype == dtype and ((y.float() - ref).abs().max() / ref.abs().max()).item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_kernel_with_a_minimum_per_group(compiled, dtype, tol):
    w = affine_weight(Q.Q5_K, n=72, seed=2)
    codes, scales, lows = K.int8_copy(w)
    for rows in (1, 4):
        x = torch.randn(rows, 512).to(dtype)
        y = K.int8_matmul(x, codes, scales, lows)
        ref = x.float() @ w.T
        assert y.dtype == dtype and ((y.float() - ref).abs().max() / ref.abs().max()).item() < tol


def test_kernel_refuses_what_it_does_not_take(compiled):
    codes, scales = K.exact_int8(gguf_weight(16, 64, Q.Q8_0))
    assert K.int8_matmul(torch.randn(K.MAX_ROWS + 1, 64), codes, scales) is None  # prefill-sized
    assert K.int8_matmul(torch.randn(2, 64).half(), codes, scales) is None
    with pytest.raises(ValueError, match="float32"):
        K.int8_matmul(torch.randn(2, 64), codes, scales.bfloat16())
    with pytest.raises(ValueError, match="codes"):
        K.int8_matmul(torch.randn(2, 32), codes, scales)
    with pytest.raises(ValueError, match="codes"):  # a scale per 8 inputs
        K.int8_matmul(torch.randn(2, 64), codes, scales.repeat_interleave(4, 1).contiguous())
    with pytest.raises(ValueError, match="lows"):
        K.int8_matmul(torch.randn(2, 64), codes, scales, scales[:, :1].contiguous())


def _linear(weight: torch.Tensor, bias: bool = True) -> Linear:
    lin = Linear(weight.shape[1], weight.shape[0], bias=bias)
    lin.weight.data = weight.clone()
    return lin


def test_linear_keeps_an_int8_copy_for_a_few_rows_in_bfloat16(compiled):
    w = gguf_weight(96, 128, Q.Q5_0)
    lin = _linear(w).requires_grad_(False)
    assert lin.find_int8() and lin.int4 is None
    lin.to(torch.bfloat16)
    lin.int8_scales = K.exact_int8(w)[1]  # as CausalLM.prepare_weights keeps them float32
    assert lin.pack() and lin.int8_codes is not None
    for rows in (1, 4, 9):
        x = torch.randn(rows, 128).bfloat16()
        ref = F.linear(x.float(), w, lin.bias.float())
        for y in (lin(x), lin(x, act="silu"), lin.times(x, torch.full((rows, 96), 2.0).bfloat16())):
            assert y.shape == (rows, 96) and y.dtype == torch.bfloat16
        assert ((lin(x).float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
        # activation and product fused or not: one bfloat16 rounding apart
        assert torch.allclose(lin(x, act="silu").float(), F.silu(lin(x)).float(), rtol=1e-2, atol=1e-2)
        assert torch.allclose(lin.times(x, torch.full((rows, 96), 2.0).bfloat16()).float(),
                              2 * lin(x).float(), rtol=1e-2, atol=1e-2)
    # A few rows go through the int8 copy, more through the packed bf16 weight.
    x = torch.randn(2, 128).bfloat16()
    assert torch.equal(lin(x), K.int8_matmul(x, lin.int8_codes, lin.int8_scales) + lin.bias)
    # The copy is checked once, when packed: scales cast with the model are refused there.
    cast = _linear(w).requires_grad_(False)
    cast.find_int8()
    cast.to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        cast.pack()


def test_linear_int8_copy_policy():
    q4 = _linear(_q4_1_weight(32, 64, seed=0)[0])
    assert q4.find_int4() and not q4.find_int8()  # a 4-bit copy is smaller still
    q5 = _linear(affine_weight(Q.Q5_1))
    assert not q5.find_int4() and q5.find_int8() and q5.int8_lows is not None
    assert not _linear(torch.randn(32, 64)).find_int8()
    f32 = _linear(gguf_weight(32, 64, Q.Q8_0))
    assert f32.find_int8() and f32.pack() and f32.int8_codes is None  # float32: the dense weight


def test_model_keeps_float32_scales(compiled, tiny_models):
    """prepare_weights casts the model; the int8 scales stay float32 (exact), and the
    vocabulary projection of a decode step goes through them."""
    from headwise.weights.loader import load_model

    model, _ = load_model(str(tiny_models["llama"]), dtype=torch.float32)
    w = gguf_weight(*model.lm_head.weight.shape, Q.Q8_0)
    model.lm_head.weight.data.copy_(w)  # tied: the embedding too
    model.prepare_weights(torch.bfloat16)
    lm = model.lm_head
    assert lm.int8_codes is not None and lm.int8_scales.dtype == torch.float32
    x = torch.randn(2, w.shape[1]).bfloat16()
    ref = x.float() @ w.T
    assert ((lm(x).float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.parametrize("tied", [True, False])
def test_an_int8_token_embedding_is_looked_up_from_its_codes(tiny_models, tokenizer_dir, tmp_path, tied):
    """An exactly-int8 embedding drops its dense weight under bfloat16 (a tied one shares
    the vocabulary projection's codes, an untied one finds its own); every row it returns
    is the one the dense bfloat16 weight held. Under float32 the dense weight stays."""
    from headwise.weights.loader import load_model
    from tests.conftest import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "tied", tokenizer_dir, tie_word_embeddings=True) if tied \
        else tiny_models["llama"]
    for dtype in (torch.bfloat16, torch.float32):
        model, _ = load_model(str(path), dtype=torch.float32)
        embed = model.model.embed_tokens
        w = gguf_weight(*embed.weight.shape, Q.Q8_0)
        embed.weight.data.copy_(w)  # tied: the projection's weight too
        model.prepare_weights(dtype)
        ids = torch.tensor([0, 5, 5, embed.num_embeddings - 1])
        rows = embed(ids)
        assert rows.dtype == dtype and torch.equal(rows, w.to(dtype)[ids])
        if dtype == torch.float32:
            assert embed.weight is not None and embed.int8_codes is None
            continue
        assert embed.weight is None and embed.int8_scales.dtype == torch.float32
        if tied:  # (the untied projection's random weight has no copy)
            assert embed.int8_codes.data_ptr() == model.lm_head.int8_codes.data_ptr()
    model, _ = load_model(str(path), dtype=torch.float32)  # a float weight: nothing to find
    model.prepare_weights(torch.bfloat16)
    assert model.model.embed_tokens.weight is not None and model.model.embed_tokens.int8_codes is None


def test_an_embedding_with_minimums_is_looked_up_from_its_codes(tokenizer_dir, tmp_path):
    """A tied Q5_1 table: the vocabulary projection keeps codes, scales and minimums, the
    embedding shares them and returns the dense bfloat16 rows (float32 rounding apart)."""
    from headwise.weights.loader import load_model
    from tests.conftest import make_tiny_model

    model, _ = load_model(str(make_tiny_model("llama", tmp_path / "tied", tokenizer_dir, tie_word_embeddings=True)),
                          dtype=torch.float32)
    embed = model.model.embed_tokens
    w = gguf_weight(*embed.weight.shape, Q.Q5_1)
    embed.weight.data.copy_(w)
    model.prepare_weights(torch.bfloat16)
    assert embed.weight is None and embed.int8_lows is model.lm_head.int8_lows
    assert embed.int8_lows.dtype == torch.float32
    ids = torch.arange(embed.num_embeddings)
    assert torch.allclose(embed(ids).float(), w.bfloat16().float(), rtol=2 ** -7, atol=0)
