"""KV cache dtypes per head class: the quantizer, byte accounting, layout files and
options, and the engine against a dense reference whose K/V go through the same
quantize/dequantize (both backends, every combination of class dtypes), with prefix
caching and the disk tier on top."""
from __future__ import annotations

import json

import pytest
import torch

from headwise import LLM, HeadLayout, SamplingParams
from headwise.heads.layout import LayoutError
from headwise.cache.manager import KVCacheManager
from headwise.cache.spec import KVClassSpec, class_specs
from headwise.config import ConfigError, EngineConfig
from headwise.engine.kv_storage import KVStorage
from headwise.layers.kv_tensor import KVTensor, dequantize, quantize
from headwise.layouts import shipped_layout
from tests.test_head_split import backend_options, dense_reference_logits, mixed_layout

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)


# ---- the quantizer ---------------------------------------------------------------------
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_quantize_error_is_half_a_step(scale_dtype):
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]  # magnitudes 1e-3..1e2
    x[0, 0] = 0.0  # an all-zero vector: zero scale floor, no NaN
    q, s = quantize(x, torch.int8, scale_dtype)
    assert q.dtype == torch.int8 and s.dtype == scale_dtype and s.shape == (50, 3)
    assert int(q.abs().max()) <= 127
    back = dequantize(q, s, torch.float32)
    step = s.float()[..., None]
    assert bool(((back - x).abs() <= step / 2 + step * 2e-2 + 1e-30).all())
    assert torch.equal(back[0, 0], torch.zeros(64))
    # The scale is as small as the vector allows: its largest entry uses most of the range.
    assert int(q[1:].abs().amax(-1).min()) >= 125


def test_fp8_quantize_keeps_three_mantissa_bits():
    x = torch.randn(20, 2, 64) * 30
    q, s = quantize(x, torch.float8_e4m3fn, torch.bfloat16)
    assert q.dtype == torch.float8_e4m3fn and float(q.float().abs().max()) <= 448
    back = dequantize(q, s, torch.float32)
    # e4m3 rounds to 3 mantissa bits (relative 1/16), down to its subnormal step 2^-9 * scale.
    bound = x.abs() / 16 + s.float()[..., None] * 2.0 ** -9 * 1.01
    assert bool(((back - x).abs() <= bound).all())


def test_kv_tensor_store_load_and_plain_views():
    data, scale = torch.zeros(4, 6, 8, dtype=torch.int8), torch.zeros(4, 6)
    kv = KVTensor(data, scale, torch.float32)
    x = torch.randn(2, 8)
    form = kv.encode(x)
    kv.put((1, torch.tensor([2, 5])), *form)
    got = kv.decode(*form)  # what reads will give back
    assert torch.equal(kv.load((1, torch.tensor([2, 5]))), got)
    assert (got - x).abs().max() < x.abs().max() / 127
    assert kv[1].load(slice(2, 3)).shape == (1, 8)
    plain = KVTensor(torch.randn(4, 6, 8), None, torch.float32)
    assert plain.plain and plain.load(1).data_ptr() == plain.data[1].data_ptr()  # a view, no copy
    half = KVTensor(torch.zeros(4, 6, 8, dtype=torch.float16), None, torch.float32)
    assert not half.plain and half.decode(*half.encode(x[0, None].expand(6, 8))).dtype == torch.float32


# ---- accounting --------------------------------------------------------------------
def test_class_bytes_count_the_scales():
    D = 64
    bf = KVClassSpec.resolve("full", "auto", torch.bfloat16, D)
    i8 = KVClassSpec.resolve("full", "int8", torch.bfloat16, D)
    assert bf.bytes_per_head_token == 2 * D * 2
    assert i8.bytes_per_head_token == 2 * (D * 1 + 2)  # int8 values + one bf16 scale, K and V
    assert KVClassSpec.resolve("window", "float16", torch.float32, D).bytes_per_head_token == 2 * D * 2
    with pytest.raises(ValueError, match="int8"):
        KVClassSpec.resolve("full", "int3", torch.float32, D)


@pytest.mark.parametrize("full_dt, window_dt", [("int8", "int8"), ("int8", "auto"), ("auto", "int8")])
def test_storage_is_exactly_what_the_books_count(full_dt, window_dt):
    """The runner's tensors hold exactly the bytes the manager budgets (scales included),
    and kv_bytes follows the per-token formula of each class."""
    L, H, D, bs = 3, 4, 16, 8
    lay = mixed_layout((L, H, D))
    lay.kv_dtype = {"paged": full_dt, "ring": window_dt}
    m = KVCacheManager(lay, bs, 1 << 22, 3, torch.float32)
    kv = KVStorage(m.geometry, m.num_blocks, m.num_ring_slots, compute_dtype=torch.float32)
    assert kv.nbytes == m.num_blocks * m.geometry.block_bytes + m.num_ring_slots * m.geometry.ring_bytes
    assert kv.nbytes <= 1 << 22
    per = {"auto": 2 * D * 4, "int8": 2 * (D + 4)}  # float32 compute: float32 scales
    nf = sum(lay.num_paged(l) for l in range(L))
    ring_tokens = sum(s.ring_size for row in lay.heads for s in row)
    n = 50
    assert m.kv_bytes(n) == -(-n // bs) * bs * nf * per[full_dt] + ring_tokens * per[window_dt]


def test_int8_halves_the_default_models_kv_and_is_the_layouts_own_choice():
    lay = shipped_layout("SmolLM2-135M-Instruct", (30, 3, 64))
    full, window = class_specs(lay, "int8", torch.bfloat16)
    assert full.dtype == window.dtype == torch.int8
    lay.kv_dtype = {"ring": "bfloat16"}  # the layout's own choice beats the option
    full, window = class_specs(lay, "int8", torch.bfloat16)
    assert (full.dtype, window.dtype) == (torch.int8, torch.bfloat16)
    a = KVCacheManager(lay, 16, 1 << 30, 2, torch.bfloat16, kv_cache_dtype="int8").kv_bytes(8192)
    lay.kv_dtype = None
    b = KVCacheManager(lay, 16, 1 << 30, 2, torch.bfloat16, kv_cache_dtype="int8").kv_bytes(8192)
    c = KVCacheManager(lay, 16, 1 << 30, 2, torch.bfloat16).kv_bytes(8192)
    assert c / b == pytest.approx(128 / 66, rel=1e-6) and b < a < c


# ---- files and options -----------------------------------------------------------------
def test_layout_files_carry_kv_dtype_and_version_1_still_loads(tmp_path):
    lay = HeadLayout.window((2, 2, 8), 4, 8)
    lay.kv_dtype = {"paged": "int8", "ring": "float16"}
    lay.save(tmp_path / "v2.json")
    d = json.loads((tmp_path / "v2.json").read_text())
    assert d["version"] == 2 and d["kv_dtype"] == {"paged": "int8", "ring": "float16"}
    assert HeadLayout.load(tmp_path / "v2.json").kv_dtype == lay.kv_dtype
    # Files written before select heads named the pools by their first class.
    (tmp_path / "old.json").write_text(json.dumps(dict(d, kv_dtype={"full": "int8", "window": "float16"})))
    assert HeadLayout.load(tmp_path / "old.json").kv_dtype == lay.kv_dtype
    (tmp_path / "twice.json").write_text(json.dumps(dict(d, kv_dtype={"full": "int8", "paged": "float16"})))
    with pytest.raises(LayoutError, match="sets 'paged' twice"):
        HeadLayout.load(tmp_path / "twice.json")
    d.update(version=1)
    del d["kv_dtype"]
    (tmp_path / "v1.json").write_text(json.dumps(d))
    assert HeadLayout.load(tmp_path / "v1.json").kv_dtype is None
    d.update(version=2, kv_dtype={"window": "int3"})
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(LayoutError, match="int3"):
        HeadLayout.load(tmp_path / "bad.json")
    d.update(kv_dtype="int8")
    (tmp_path / "bad2.json").write_text(json.dumps(d))
    with pytest.raises(LayoutError, match="kv_dtype"):
        HeadLayout.load(tmp_path / "bad2.json")


def test_bad_kv_cache_dtype_names_the_choices(tiny_models, tmp_path):
    with pytest.raises(ConfigError, match="int8.*fp8_e4m3"):
        EngineConfig(kv_cache_dtype="int3")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="fp8_e4m3.*CUDA.*int8"):
            EngineConfig(kv_cache_dtype="fp8_e4m3")
        path = str(tiny_models["llama"])
        lay = HeadLayout.full(LLM(path, head_layout="full", kv_cache_memory=1 << 22).layout.shape)
        lay.kv_dtype = {"paged": "fp8_e4m3"}
        with pytest.raises(ConfigError, match="fp8_e4m3.*CUDA"):
            LLM(path, head_layout=lay, kv_cache_memory=1 << 22)


# ---- the engine ----------------------------------------------------------------------
def _round(name: str):
    if name == "int8":
        return lambda t: dequantize(*quantize(t, torch.int8, torch.float32), torch.float32)
    if name == "float16":
        return lambda t: t.to(torch.float16).float()
    return lambda t: t


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("full_dt, window_dt", [("int8", "int8"), ("int8", "auto"), ("auto", "int8"),
                                                ("float16", "int8")])
def test_engine_matches_quantized_dense_reference(tiny_models, backend, full_dt, window_dt):
    """Chunked and one-pass prefill and 48 decode steps, every class dtype pair, against
    dense attention over the same quantized-then-dequantized K/V."""
    path = str(tiny_models["llama"])
    shape = LLM(path, head_layout="full", kv_cache_memory=1 << 22).layout.shape
    lay = mixed_layout(shape)
    opts = backend_options(backend)
    if full_dt == window_dt:  # the option, not the layout, chooses
        opts["kv_cache_dtype"] = full_dt
    else:
        lay.kv_dtype = {"paged": full_dt, "ring": window_dt}
    llm = LLM(path, head_layout=lay, kv_cache_memory=1 << 24, max_num_batched_tokens=7, dtype="float32", **opts)
    geo = llm.engine.cache.geometry
    assert str(geo.paged.dtype).endswith({"auto": "float32"}.get(full_dt, full_dt))
    assert str(geo.ring.dtype).endswith({"auto": "float32"}.get(window_dt, window_dt))
    rounds = {"full": _round(full_dt), "window": _round(window_dt)}
    ids = llm.tokenizer.encode("A long prompt about rivers, towns and bridges, " * 3)
    with torch.no_grad():
        ref = dense_reference_logits(llm, ids, kv_round=rounds)
        exact = dense_reference_logits(llm, ids)
    assert (ref - exact).abs().max() > 1e-4  # quantization is visible to the reference
    for chunk in (len(ids), 7):
        got = llm.engine.prompt_logits(ids, chunk_size=chunk)
        assert (got - ref).abs().max().item() < 2e-4
    out = llm.generate([ids], SamplingParams(max_tokens=48, ignore_eos=True, logprobs=0))[0]
    with torch.no_grad():
        ref = torch.log_softmax(dense_reference_logits(llm, ids + out.token_ids, kv_round=rounds), -1)
    for t, tok in enumerate(out.token_ids):
        row = len(ids) - 1 + t
        assert tok == int(ref[row].argmax())
        assert abs(out.logprobs[t] - float(ref[row, tok])) < 2e-4


@pytest.mark.parametrize("kind", ["window", "mixed"])
def test_int8_prefix_hits_equal_uncached(tiny_models, kind):
    """Cached blocks and ring snapshots carry their scales: follow-ups served from the
    prefix cache equal computing them from scratch."""
    path = str(tiny_models["llama"])
    shape = LLM(path, head_layout="full", kv_cache_memory=1 << 22).layout.shape
    lay = mixed_layout(shape) if kind == "mixed" else HeadLayout.window(shape, 4, 8)
    opts = dict(head_layout=lay, kv_cache_memory=1 << 24, block_size=4, dtype="float32",
                kv_cache_dtype="int8", max_num_batched_tokens=16)
    cached, plain = LLM(path, **opts), LLM(path, enable_prefix_caching=False, **opts)
    tok = cached.tokenizer
    doc = tok.encode("A report on rivers, bridges and the towns between them. " * 6)
    for q in (" Which town?", " Name every bridge in it, please."):
        ids = doc + tok.encode(q, add_special_tokens=False)
        a, b = cached.generate([ids], GREEDY, use_tqdm=False)[0], plain.generate([ids], GREEDY, use_tqdm=False)[0]
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert a.num_cached_tokens > len(doc) - 16


def test_int8_prefix_from_disk_equals_recompute(tiny_models, tmp_path):
    from tests.test_disk_tier import _docs

    path = str(tiny_models["llama"])
    shape = LLM(path, head_layout="full", kv_cache_memory=1 << 22).layout.shape
    lay = mixed_layout(shape)
    geo = KVCacheManager(lay, 4, 1 << 30, 1, torch.float32, kv_cache_dtype="int8").geometry
    opts = dict(head_layout=lay, block_size=4, dtype="float32", max_num_seqs=1, kv_cache_dtype="int8",
                kv_cache_memory=geo.ring_bytes + int(1.5 * (geo.seq_bytes(130) + 2 * geo.ring_bytes)))
    tiered, plain = LLM(path, kv_offload_dir=str(tmp_path), **opts), LLM(path, enable_prefix_caching=False, **opts)
    tok = tiered.tokenizer
    a = _docs(tok)[0]
    q = tok.encode(" Question: what is it about?", add_special_tokens=False)
    tiered.generate([a], GREEDY, use_tqdm=False)
    for i in range(4):  # push a out of memory, to disk
        tiered.generate([tok.encode(f"Another document {i} about towns. " * 20)[:110]], GREEDY, use_tqdm=False)
    tiered.engine.cache.tier.flush()
    got = tiered.generate([a + q], GREEDY, use_tqdm=False)[0]
    want = plain.generate([a + q], GREEDY, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids
    assert max(abs(x - y) for x, y in zip(got.logprobs, want.logprobs)) < 1e-4
    assert got.num_cached_tokens >= 100 and tiered.engine.cache.tier.stats.hit_tokens > 0
    tiered.close()


def test_server_with_int8_kv_answers_as_offline_and_reports_its_format(tiny_models):
    from tests.test_server import _client, _metric, running_server

    path = str(tiny_models["llama"])
    shape = LLM(path, head_layout="full", kv_cache_memory=1 << 22).layout.shape
    opts = dict(head_layout=mixed_layout(shape), kv_cache_dtype="int8", dtype="float32")
    offline = LLM(path, kv_cache_memory=1 << 24, max_model_len=512, **opts)
    prompt = "The river runs through the old town and " * 4
    want = offline.generate([prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].text
    with running_server(path, **opts) as (url, _):
        c = _client(url)
        got = c.completions.create(model=c.models.list().data[0].id, prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == want
        D = shape[2]
        for cls in ("full", "window"):
            assert _metric(url, "headwise:kv_cache_bytes_per_token", head_class=cls,
                           kv_dtype="int8*float32") == 2 * (D + 4)
