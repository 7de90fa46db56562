"""The C decode kernel (kernels/cpu_decode.c): it compiles wherever a C compiler is, it
attends paged blocks and rings as SDPA does over the same keys, it writes the step's own
K/V where the general path writes them, and engines with and without it give the same
tokens."""
from __future__ import annotations

import platform
import shutil
import threading

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from headwise import LLM, SamplingParams
from headwise.heads.layout import HeadLayout
from headwise.cache.spec import KVClassSpec
from headwise.kernels import codes_gemm, cpu_kernels, int8_matmul, pointwise
from headwise.layers.kv_tensor import dequantize, quantize
from headwise.layers.norm import RMSNorm
from headwise.layers import torch_attention
from tests.test_decode_capture import PROMPTS, _mixed
from tests import test_codes_gemm, test_int8_matmul, test_pointwise

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


@pytest.mark.parametrize("dtype,kv", [(torch.float32, "plain"), (torch.bfloat16, "plain"),
                                      (torch.float32, "int8"), (torch.bfloat16, "int8")])
@pytest.mark.parametrize("nkv,g,D", [(3, 3, 64), (1, 4, 256), (2, 1, 32)])
def test_paged_blocks_match_sdpa(compiled, dtype, kv, nkv, g, D):
    """Against SDPA over the same keys (int8: over their dequantized values)."""
    torch.manual_seed(0)
    bs, nblocks = 16, 300
    pool = torch.randn(2, nkv, nblocks * bs, D).to(dtype)  # [2, heads, slots, D]
    scales = None
    if kv == "int8":
        codes, s = quantize(pool, torch.int8, dtype)
        pool, scales = codes, (s[0], s[1], bs * s.stride(2))
    # lengths: one key, inside one block, across pieces the kernel cuts for threads
    lens = torch.tensor([1, 17, 1000, 333], dtype=torch.int32)
    B = len(lens)
    table = torch.randperm(nblocks)[: B * 64].to(torch.int32).view(B, 64).contiguous()
    q = torch.randn(B, nkv * g, D).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = D ** -0.5
    call = cpu_kernels.DecodeCall(pool[0], pool[1], bs, bs * pool.stride(2), g, scales=scales)
    call(q, out, table, lens, scale)
    values = pool if scales is None else dequantize(pool, torch.stack(scales[:2]), torch.float32)
    for b in range(B):
        slots = (table[b].long()[:, None] * bs + torch.arange(bs)).flatten()[: lens[b]]
        ref = _reference(q[b], values[0][:, slots], values[1][:, slots], scale)
        torch.testing.assert_close(out[b].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype,kv", [(torch.float32, "plain"), (torch.bfloat16, "plain"), (torch.bfloat16, "int8")])
def test_rings_match_sdpa_and_take_the_new_token(compiled, dtype, kv):
    """A window group of KV heads [1, 3) of a 3-head layer, rings [S, n, R, D] (a view of
    [2, S, n, R, D]): its new K/V are written at each sequence's ring index (int8:
    quantized exactly as kv_tensor.quantize does), each sequence attends its first
    min(len, R) entries, and the other head's outputs stay untouched."""
    torch.manual_seed(1)
    S, n, R, D, g, Hkv = 5, 2, 40, 64, 3, 3
    rings = torch.randn(2, S, n, R, D).to(dtype)
    ring_scales, scales = None, None
    if kv == "int8":
        rings, ring_scales = quantize(rings, torch.int8, dtype)  # [2, S, n, R, D], [2, S, n, R]
        ks, vs = ring_scales[0].transpose(0, 1), ring_scales[1].transpose(0, 1)
        scales = (ks, vs, ks.stride(1))
    before = rings.clone()
    before_scales = None if ring_scales is None else ring_scales.clone()
    slots = torch.tensor([[4], [0], [2]], dtype=torch.int32)
    lens = torch.tensor([100, 7, 40], dtype=torch.int32)
    rows = torch.tensor([13, 6, 39], dtype=torch.int64)  # where each new token goes
    B = len(lens)
    q = torch.randn(B, Hkv * g, D).to(dtype)
    new = torch.randn(B, 2, Hkv, D).to(dtype)  # K and V with strides unlike the ring's
    out = torch.full_like(q, float("nan"))
    k, v = rings[0].transpose(0, 1), rings[1].transpose(0, 1)  # [n, S, R, D]
    call = cpu_kernels.DecodeCall(k, v, R, k.stride(1), g, head=1, cap=R, scales=scales)
    call(q, out, slots, lens, D ** -0.5, (new[:, 0], new[:, 1], rows))
    expect, expect_scales = before.clone(), before_scales
    for b in range(B):
        s = int(slots[b, 0])
        if kv == "int8":
            codes, sc = quantize(new[b, :, 1:], torch.int8, dtype)  # [2, n, D], [2, n]
            expect[:, s, :, rows[b]], expect_scales[:, s, :, rows[b]] = codes, sc
        else:
            expect[:, s, :, rows[b]] = new[b, :, 1:]
    assert torch.equal(rings, expect)  # the new rows, and nothing else
    if kv == "int8":
        assert torch.equal(ring_scales, expect_scales)
    assert out[:, :g].isnan().all()  # head 0's queries are not the class's
    values = rings if kv == "plain" else dequantize(rings, ring_scales, torch.float32)
    for b in range(B):
        s, L = int(slots[b, 0]), min(int(lens[b]), R)
        ref = _reference(q[b, g:], values[0, s, :, :L], values[1, s, :, :L], D ** -0.5)
        torch.testing.assert_close(out[b, g:].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_bad_arguments_are_refused(compiled):
    kv = torch.zeros(2, 1, 64, 16)
    call = cpu_kernels.DecodeCall(kv[0], kv[1], 16, 16 * 16, 1)
    q = torch.zeros(1, 1, 16)
    table, one = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        call(q, q.clone(), table.long(), one, 1.0)
    with pytest.raises(ValueError, match="past its table"):  # 65 keys, 4 blocks of 16
        call(q, q.clone(), table, torch.tensor([65], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="query heads"):  # 20 query heads per KV head: over MAX_G
        wide = cpu_kernels.DecodeCall(kv[0], kv[1], 16, 16 * 16, 20)
        wide(torch.zeros(1, 20, 16), torch.zeros(1, 20, 16), table, one, 1.0)
    with pytest.raises(ValueError, match="query heads"):  # rows of 8: not a multiple of 16
        narrow = torch.zeros(2, 1, 64, 8)
        cpu_kernels.DecodeCall(narrow[0], narrow[1], 16, 16 * 8, 1)(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8),
                                                                     table, one, 1.0)
    with pytest.raises(ValueError, match=r"\[B, >= 1, 16\]"):  # head size 32 against a cache of 16
        call(torch.zeros(1, 1, 32), torch.zeros(1, 1, 32), table, one, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        call(q.double(), q.double(), table, one, 1.0)
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        cpu_kernels.DecodeCall(kv[0].half(), kv[1].half(), 16, 16 * 16, 1)
    with pytest.raises(ValueError, match="need their scales"):
        cpu_kernels.DecodeCall(kv[0].to(torch.int8), kv[1].to(torch.int8), 16, 16 * 16, 1)


@pytest.mark.parametrize("layout,budget,kv", [("full", 2048, "auto"), ("mixed", 2048, "auto"), ("mixed", 16, "auto"),
                                              ("mixed", 2048, "int8"), ("mixed", 16, "int8")])
def test_engine_tokens_equal_without_the_kernel(compiled, tiny_models, monkeypatch, layout, budget, kv):
    """float32 greedy tokens and logprobs with the kernel and with PyTorch's attention (the
    path of machines without a compiler), plain and int8 caches, batch of 3, the window
    ring filling and wrapping. With a 16-token step budget, prompts are prefilled in chunks beside other
    sequences' decode rows: those steps take the kernel for their decode rows too."""
    path = str(tiny_models["llama"])
    opts = dict(head_layout="full" if layout == "full" else _mixed(), kv_cache_memory=1 << 24,
                dtype="float32", block_size=4, enforce_eager=True, max_num_batched_tokens=budget,
                kv_cache_dtype=kv)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)
    calls, mixed = [], []
    real = cpu_kernels.DecodeCall.__call__

    def counted(self, q, out, table, lens, scale, new=None):
        calls.append(1)
        mixed.append(new is None)  # called from a class's torch_decode: a mixed step
        return real(self, q, out, table, lens, scale, new)

    monkeypatch.setattr(cpu_kernels.DecodeCall, "__call__", counted)
    with_kernel = LLM(path, **opts)
    assert with_kernel.engine.runner.metadata.kernel
    fast = with_kernel.generate(PROMPTS, params, use_tqdm=False)
    assert calls, "decode did not go through the kernel"
    assert any(mixed) == (budget < 100)
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    without = LLM(path, **opts)
    assert not without.engine.runner.metadata.kernel
    calls.clear()
    slow = without.generate(PROMPTS, params, use_tqdm=False)
    assert not calls
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x - y) < 1e-4


def test_float16_caches_keep_the_general_path(compiled, tiny_models, monkeypatch):
    """float16 caches under float32 compute are not the kernel's (values neither stored as
    computed nor int8): the runner builds no kernel metadata, no layer calls the kernel,
    and decode still works."""
    calls = []
    monkeypatch.setattr(cpu_kernels.DecodeCall, "__call__", lambda self, *a, **k: calls.append(1))
    llm = LLM(str(tiny_models["llama"]), head_layout=_mixed(), kv_cache_memory=1 << 24, dtype="float32",
              block_size=4, kv_cache_dtype="float16", enforce_eager=True)
    runner = llm.engine.runner
    assert not runner.metadata.kernel and not runner.metadata.paged_by_kernel
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert len(out.token_ids) == 4
    assert not calls
    states = [a.backend_state for a in runner.model.attention_layers()]
    assert states and all(s is None or not s.ok for s in states)


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """library() rebuilt under a temporary cache directory, and forgotten afterwards."""
    monkeypatch.setenv("HEADWISE_CACHE_DIR", str(tmp_path / "cache"))
    _forget_libraries()
    yield tmp_path
    _forget_libraries()


def _forget_libraries() -> None:
    for f in (cpu_kernels._load, cpu_kernels.library, cpu_kernels.pointwise_library, cpu_kernels.matmul_library,
              cpu_kernels.select_library, cpu_kernels.gemm_library):
        f.cache_clear()


def test_kernels_built_beside_each_other_are_compiled_once(fresh_build, monkeypatch):
    """An engine builds its kernels on a thread while its weights load (build_for_engine),
    and another caller may ask for one meanwhile: each kernel is compiled once, and every
    caller gets it."""
    real = shutil.which("cc") or shutil.which("gcc")
    calls = fresh_build / "compiles"
    wrapper = fresh_build / "cc-counting"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *--version*) ;; *) echo "$*" >> {calls} ;; esac\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    got = []
    threads = [threading.Thread(target=cpu_kernels.build_for_engine, args=(True,)) for _ in range(2)]
    threads.append(threading.Thread(target=lambda: got.append(cpu_kernels.library())))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sources = [line.split(".c ")[0].rsplit("/", 1)[-1] for line in calls.read_text().splitlines()]
    # each once (which others an engine builds beside these depends on the CPU, and on
    # what earlier tests of the process built: cpu_prefill, cpu_weights)
    assert len(sources) == len(set(sources))
    assert {"cpu_decode", "cpu_matmul", "cpu_pointwise", "cpu_select"} <= set(sources)
    assert got[0] is not None and cpu_kernels.select_library() is not None


def test_a_failing_compiler_means_pytorch_attention(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    with caplog.at_level("WARNING", logger="headwise.kernels"):
        assert cpu_kernels.library() is None
        assert cpu_kernels.pointwise_library() is None
        assert cpu_kernels.matmul_library() is None
    assert len([r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]) == 3
    x = torch.randn(8, 64)
    assert pointwise.rms_norm(x, torch.ones(64), 1e-6) is None  # the layers keep PyTorch's code
    codes, scales = int8_matmul.exact_int8(test_int8_matmul.gguf_weight(16, 64, GGMLQuantizationType.Q8_0))
    assert int8_matmul.int8_matmul(x[:2], codes, scales) is None  # linears: their packed weight
    assert torch.equal(RMSNorm(64, 1e-6)(x), F.rms_norm(x, (64,), torch.ones(64), 1e-6))
    spec = KVClassSpec.resolve("full", "auto", torch.float32, 64)
    assert not torch_attention.decode_kernel(torch.device("cpu"), spec, torch.float32)
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
        assert cpu_kernels.pointwise_library() is not None
        assert cpu_kernels.matmul_library() is not None
    assert any("without OpenMP" in r.getMessage() for r in caplog.records)
    test_paged_blocks_match_sdpa(None, torch.float32, "int8", 3, 3, 64)
    test_pointwise.test_rotary_is_pytorch_bit_for_bit(torch.bfloat16, True)
    test_pointwise.test_rms_norm_matches_pytorch(torch.bfloat16, 1e-2)
    test_int8_matmul.test_kernel_matches_the_dequantized_weight(None, torch.bfloat16, 8e-3, 3)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 flag")
def test_the_portable_code_path_without_avx512(compiled, fresh_build, monkeypatch):
    """Built for a CPU without AVX-512 (as many laptops are), the kernel's generic vector
    code gives the same results as its intrinsics."""
    real = shutil.which("cc") or shutil.which("gcc")
    wrapper = fresh_build / "cc-no-avx512"
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@" -mno-avx512f\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    assert cpu_kernels.library() is not None
    test_paged_blocks_match_sdpa(None, torch.bfloat16, "int8", 1, 4, 256)
    test_paged_blocks_match_sdpa(None, torch.float32, "plain", 3, 3, 64)
    test_rings_match_sdpa_and_take_the_new_token(None, torch.bfloat16, "plain")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):  # cpu_matmul.c's portable loop
        test_int8_matmul.test_kernel_matches_the_dequantized_weight(None, dtype, tol, 4)
        test_int8_matmul.test_kernel_with_a_scale_per_16_inputs(None, dtype, tol)
        test_int8_matmul.test_kernel_with_a_minimum_per_group(None, dtype, tol)
    # the matmuls over codes need AVX512-BF16: built without it, they decline (the engine
    # keeps its path, and a layer with int8 codes keeps its dense weight)
    packed, sz, _ = test_codes_gemm.weight(64, 64, seed=0)
    q = test_codes_gemm.int8_weight(64, 64, 16, False, seed=0)
    assert cpu_kernels.gemm_library() is not None
    assert codes_gemm.int4_gemm(torch.ones(2, 64, dtype=torch.bfloat16), packed, sz) is None
    assert codes_gemm.int8_gemm(torch.ones(6, 64, dtype=torch.bfloat16), q.codes, q.scales) is None
    assert not codes_gemm.int8_gemm_takes(q.codes, q.scales, None)


@pytest.mark.parametrize("kv_dtype", [{"paged": "int8", "ring": "float16"}, {"paged": "float16", "ring": "int8"}])
def test_one_class_through_the_kernel_the_other_not(compiled, tiny_models, kv_dtype):
    """Per-class KV dtypes where the kernel takes one class only: that class decodes
    through it (the runner builds block tables or slot runs to match), the other through
    PyTorch's code, and greedy tokens equal an engine without the kernel's classes."""
    path = str(tiny_models["llama"])
    base = _mixed()
    lay = HeadLayout(base.name, base.num_layers, base.num_kv_heads, base.head_dim, base.heads, kv_dtype=kv_dtype)
    opts = dict(kv_cache_memory=1 << 24, dtype="float32", block_size=4, enforce_eager=True)
    llm = LLM(path, head_layout=lay, **opts)
    runner = llm.engine.runner
    assert runner.metadata.kernel and runner.metadata.paged_by_kernel == (kv_dtype["paged"] == "int8")
    params = SamplingParams(max_tokens=16, temperature=0.0)
    got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    ref = LLM(path, head_layout=lay, **opts)
    ref.engine.runner.metadata.kernel = ref.engine.runner.metadata.paged_by_kernel = False  # PyTorch's code
    assert got == [o.token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
