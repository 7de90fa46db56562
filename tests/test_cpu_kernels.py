"""The C decode kernel (kernels/cpu_decode.c): it compiles wherever a C compiler is, it
attends paged blocks and rings as SDPA does over the same keys, it writes the step's own
K/V where the general path writes them, and engines with and without it give the same
tokens."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from headwise import LLM, SamplingParams
from headwise.kernels import cpu_kernels
from headwise.layers import torch_attention
from tests.test_decode_capture import PROMPTS, _mixed

TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def compiled():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the backend keeps PyTorch's attention")
    assert cpu_kernels.library() is not None, "a C compiler is here but the kernel did not build"


def _reference(q, keys, values, scale):
    # q [nkv * g, D]; keys, values [nkv, L, D] -> [nkv * g, D], float32
    nkv, _, D = keys.shape
    return F.scaled_dot_product_attention(q.float().view(nkv, -1, D), keys.float(), values.float(),
                                          scale=scale).view(-1, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nkv,g,D", [(3, 3, 64), (1, 4, 256), (2, 1, 32)])
def test_paged_blocks_match_sdpa(compiled, dtype, nkv, g, D):
    torch.manual_seed(0)
    bs, nblocks = 16, 300
    kv = torch.randn(2, nkv, nblocks * bs, D).to(dtype)  # a pool [2, heads, slots, D]
    # lengths: one key, inside one block, across pieces the kernel cuts for threads
    lens = torch.tensor([1, 17, 1000, 333], dtype=torch.int32)
    B = len(lens)
    table = torch.randperm(nblocks)[: B * 64].to(torch.int32).view(B, 64).contiguous()
    q = torch.randn(B, nkv * g, D).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = D ** -0.5
    call = cpu_kernels.DecodeCall(kv[0], kv[1], bs, bs * kv.stride(2), g)
    call(q, out, table, lens, scale)
    for b in range(B):
        slots = (table[b].long()[:, None] * bs + torch.arange(bs)).flatten()[: lens[b]]
        ref = _reference(q[b], kv[0][:, slots], kv[1][:, slots], scale)
        torch.testing.assert_close(out[b].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rings_match_sdpa_and_take_the_new_token(compiled, dtype):
    """A window group of KV heads [1, 3) of a 3-head layer, rings [S, n, R, D] (a view of
    [2, S, n, R, D]): its new K/V are written at each sequence's ring index, each sequence
    attends its first min(len, R) entries, and the other head's outputs stay untouched."""
    torch.manual_seed(1)
    S, n, R, D, g, Hkv = 5, 2, 40, 64, 3, 3
    rings = torch.randn(2, S, n, R, D).to(dtype)
    before = rings.clone()
    slots = torch.tensor([[4], [0], [2]], dtype=torch.int32)
    lens = torch.tensor([100, 7, 40], dtype=torch.int32)
    rows = torch.tensor([13, 6, 39], dtype=torch.int64)  # where each new token goes
    B = len(lens)
    q = torch.randn(B, Hkv * g, D).to(dtype)
    new = torch.randn(B, 2, Hkv, D).to(dtype)  # K and V with strides unlike the ring's
    out = torch.full_like(q, float("nan"))
    k, v = rings[0].transpose(0, 1), rings[1].transpose(0, 1)  # [n, S, R, D]
    call = cpu_kernels.DecodeCall(k, v, R, k.stride(1), g, head=1, cap=R)
    call(q, out, slots, lens, D ** -0.5, (new[:, 0], new[:, 1], rows))
    expect = before.clone()
    for b in range(B):
        s = int(slots[b, 0])
        expect[0, s, :, rows[b]] = new[b, 0, 1:]
        expect[1, s, :, rows[b]] = new[b, 1, 1:]
    assert torch.equal(rings, expect)  # the new rows, and nothing else
    assert out[:, :g].isnan().all()  # head 0's queries are not the class's
    for b in range(B):
        s, L = int(slots[b, 0]), min(int(lens[b]), R)
        ref = _reference(q[b, g:], rings[0, s, :, :L], rings[1, s, :, :L], D ** -0.5)
        torch.testing.assert_close(out[b, g:].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_bad_arguments_are_refused(compiled):
    kv = torch.zeros(2, 1, 64, 8)
    call = cpu_kernels.DecodeCall(kv[0], kv[1], 16, 16 * 8, 1)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="int32"):
        call(q, q.clone(), torch.zeros(1, 4, dtype=torch.int64), torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="past its table"):  # 65 keys, 4 blocks of 16
        call(q, q.clone(), torch.zeros(1, 4, dtype=torch.int32), torch.tensor([65], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="query heads"):  # 20 query heads per KV head: over MAX_G
        wide = cpu_kernels.DecodeCall(kv[0], kv[1], 16, 16 * 8, 20)
        wide(torch.zeros(1, 20, 8), torch.zeros(1, 20, 8), torch.zeros(1, 4, dtype=torch.int32),
             torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match=r"\[B, >= 1, 8\]"):  # head size 16 against a cache of 8
        call(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.zeros(1, 4, dtype=torch.int32),
             torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="dtype"):
        call(q.double(), q.double(), torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.DecodeCall(kv[0].half(), kv[1].half(), 16, 16 * 8, 1)


@pytest.mark.parametrize("layout", ["full", "mixed"])
def test_engine_tokens_equal_without_the_kernel(compiled, tiny_models, monkeypatch, layout):
    """float32 greedy tokens and logprobs with the kernel (one call per class and layer)
    and with PyTorch's attention (the path of machines without a compiler), batch of 3,
    the window ring filling and wrapping."""
    path = str(tiny_models["llama"])
    opts = dict(head_layout="full" if layout == "full" else _mixed(), kv_cache_memory=1 << 24,
                dtype="float32", block_size=4, enforce_eager=True)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)
    calls = []
    real = cpu_kernels.DecodeCall.__call__
    monkeypatch.setattr(cpu_kernels.DecodeCall, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    with_kernel = LLM(path, **opts)
    assert with_kernel.engine.runner.decode_tables
    fast = with_kernel.generate(PROMPTS, params, use_tqdm=False)
    assert calls, "decode did not go through the kernel"
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    without = LLM(path, **opts)
    assert not without.engine.runner.decode_tables
    calls.clear()
    slow = without.generate(PROMPTS, params, use_tqdm=False)
    assert not calls
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x - y) < 1e-4


def test_quantized_layers_keep_the_general_path(compiled, tiny_models):
    """int8 caches are not the kernel's: the layer's state says so and decode still works."""
    llm = LLM(str(tiny_models["llama"]), head_layout=_mixed(), kv_cache_memory=1 << 24, dtype="float32",
              block_size=4, kv_cache_dtype="int8", enforce_eager=True)
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert len(out.token_ids) == 4
    states = [a.backend_state for a in llm.engine.runner.model.attention_layers()]
    assert states and all(isinstance(s, torch_attention.KernelCalls) and not s.ok for s in states)


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """library() rebuilt under a temporary cache directory, and forgotten afterwards."""
    monkeypatch.setenv("HEADWISE_CACHE_DIR", str(tmp_path / "cache"))
    cpu_kernels.library.cache_clear()
    yield tmp_path
    cpu_kernels.library.cache_clear()


def test_a_failing_compiler_means_pytorch_attention(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    with caplog.at_level("WARNING", logger="headwise.kernels"):
        assert cpu_kernels.library() is None
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert not torch_attention.decode_kernel(torch.device("cpu"))
    assert not list((fresh_build / "cache").rglob("*.tmp"))  # no half-written library left


def test_without_openmp_the_kernel_runs_on_one_thread(compiled, fresh_build, monkeypatch, caplog):
    """A compiler without OpenMP support (as Apple's clang): built without it, same results."""
    real = shutil.which("cc") or shutil.which("gcc")
    wrapper = fresh_build / "cc-no-openmp"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    with caplog.at_level("WARNING", logger="headwise.kernels"):
        assert cpu_kernels.library() is not None
    assert any("without OpenMP" in r.getMessage() for r in caplog.records)
    test_paged_blocks_match_sdpa(None, torch.float32, 3, 3, 64)
