"""The prepacked linear layer against plain F.linear, packed and not."""
import pytest
import torch
import torch.nn.functional as F

from headwise.layers.linear import Linear, can_pack


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


def test_engine_packs_cpu_weights(tiny_models):
    from headwise import LLM

    llm = LLM(str(tiny_models["llama"]), head_layout="full", kv_cache_memory=1 << 22)
    lins = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    if can_pack(llm.engine.model.model.embed_tokens.weight):
        assert lins and all(m.packed is not None and m.weight is None for m in lins)
