"""Head-split cache: window and mixed layouts against a dense masked reference, the
`full` layout against the plain engine, ring-slot mapping, and layout files."""
import json

import pytest
import torch

from headwise import LLM, HeadLayout, SamplingParams
from headwise.heads.layout import HeadSpec, LayoutError
from headwise.layouts import _DIR, SHIPPED, SHIPPED_SELECT, shipped_layout
from tests.conftest import assert_batched_equals_single

SINK, WINDOW = 4, 8
# The Triton backend runs on a GPU when there is one, else in Triton's interpreter on CPU.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def backend_options(backend: str) -> dict:
    if backend == "triton":
        pytest.importorskip("triton")
        return dict(attention_backend="triton", device=KERNEL_DEVICE, block_size=4)
    return dict(attention_backend="torch")


def dense_reference_logits(llm: LLM, ids: list[int], rebased: bool = False, kv_round=None,
                           masks=None) -> torch.Tensor:
    """Full-sequence forward with plain per-head masks: full heads causal, window heads
    causal and (j < sink or j > i - window). No cache; written for clarity.
    masks: head class -> fn(spec, i, j) giving the keys a head of that class keeps
    (ANDed with causal), for classes defined by a test.
    rebased: window heads see sink keys at the distance they would have if the evicted
    tokens were dropped (StreamingLLM): the query sits at i - max(0, i - (sink + window - 1)).
    kv_round: per head class, a function giving K/V [T, D] as a quantized cache holds them."""
    model, layout = llm.engine.model, llm.engine.layout
    cfg = model.config
    T = len(ids)
    dev = model.model.embed_tokens.weight.device
    pos = torch.arange(T, device=dev)
    i, j = pos[:, None], pos[None, :]
    x = model.model.embed_tokens(torch.tensor(ids, device=dev))
    for l, layer in enumerate(model.model.layers):
        att = layer.self_attn
        h = layer.input_layernorm(x)
        q = att.q_proj(h).view(T, cfg.num_heads, cfg.head_dim)
        k = att.k_proj(h).view(T, cfg.num_kv_heads, cfg.head_dim)
        v = att.v_proj(h).view(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = att.q_norm(q), att.k_norm(k)
        q0, k0 = q, k
        q, k = model.model.rotary(pos, q0, k0)
        order = layout.head_order(l)  # storage position -> original head
        outs = []
        for qh in range(cfg.num_heads):
            kh = qh // cfg.group_size
            spec = layout.heads[l][order[kh]]
            rt = (kv_round or {}).get(spec.kind, lambda t: t)
            kk, vv = rt(k[:, kh]), rt(v[:, kh])
            mask = j <= i
            if spec.kind == "window":
                mask = mask & ((j < spec.sink) | (j > i - spec.window))
            elif masks and spec.kind in masks:
                mask = mask & masks[spec.kind](spec, i, j)
            s = (q[:, qh] @ kk.T) / cfg.head_dim ** 0.5
            if rebased and spec.kind == "window":
                delta = (pos - (spec.sink + spec.window - 1)).clamp(min=0)
                q_at = model.model.rotary(pos - delta, q0, k0)[0]
                s = torch.where(j < spec.sink, (q_at[:, qh] @ kk.T) / cfg.head_dim ** 0.5, s)
            s = s.masked_fill(~mask, float("-inf"))
            outs.append(torch.softmax(s, -1) @ vv)
        x = x + att.o_proj(torch.stack(outs, 1).reshape(T, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x)).float().cpu()


def mixed_layout(shape):
    L, H, D = shape
    heads = [[HeadSpec("window", SINK, WINDOW) if (l + h) % 2 else HeadSpec("full") for h in range(H)]
             for l in range(L)]
    heads[0][0] = HeadSpec("window", 2, 5)  # a second window size in one layer
    return HeadLayout("mixed", L, H, D, heads)


def _layout(kind, shape):
    if kind == "window":
        return HeadLayout.window(shape, SINK, WINDOW)
    return mixed_layout(shape)


# Triton (its interpreter here, ~9 s a case) on one architecture and the layout with both
# classes; test_triton_backend_equals_torch_backend_batched covers the rest.
@pytest.mark.parametrize("kind,arch,backend", [(k, a, "torch") for k in ("window", "mixed") for a in ("llama", "qwen3")]
                         + [("mixed", "llama", "triton")])
def test_prefill_and_decode_match_dense_reference(kind, arch, backend, tiny_models):
    path = str(tiny_models[arch])
    probe = LLM(path, head_layout="full", kv_cache_memory=1 << 24)
    shape = probe.layout.shape
    llm = LLM(path, head_layout=_layout(kind, shape), kv_cache_memory=1 << 24, max_num_batched_tokens=7,
              **backend_options(backend))
    ids = llm.tokenizer.encode("A long prompt about rivers, towns and bridges, " * 3)
    assert len(ids) > SINK + WINDOW
    with torch.no_grad():
        ref = dense_reference_logits(llm, ids)
    for chunk in (len(ids), 7):  # one pass, and chunked so chunks cross the ring
        got = llm.engine.prompt_logits(ids, chunk_size=chunk)
        assert (got - ref).abs().max().item() < 1e-4
    # 64 greedy decode steps (the ring wraps many times); each step's logits checked.
    out = llm.generate([ids], SamplingParams(max_tokens=64, ignore_eos=True, logprobs=0))[0]
    full_ids = ids + out.token_ids
    with torch.no_grad():
        ref = dense_reference_logits(llm, full_ids)
    ref_lp = torch.log_softmax(ref, -1)
    for t, tok in enumerate(out.token_ids):
        row = len(ids) - 1 + t
        assert tok == int(ref[row].argmax())
        assert abs(out.logprobs[t] - float(ref_lp[row, tok])) < 1e-4


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_rebased_positions_match_dense_reference(tiny_models, kv):
    """StreamingLLM-style positions through chunked prefill and 40 decode steps (both
    ring paths: the batched one needs most ring slots busy, so max_num_seqs=1); int8:
    also the sink scores of the quantized decode path, against K/V quantized alike."""
    from headwise.layers.kv_tensor import dequantize, quantize

    path = str(tiny_models["llama"])
    probe = LLM(path, head_layout="full", kv_cache_memory=1 << 24)
    layout = mixed_layout(probe.layout.shape)
    ids = probe.tokenizer.encode("A long prompt about rivers, towns and bridges, " * 3)
    rt = None
    if kv == "int8":
        q8 = lambda t: dequantize(*quantize(t, torch.int8, torch.float32), torch.float32)  # noqa: E731
        rt = {"full": q8, "window": q8}
    for seqs in (1, 4):
        llm = LLM(path, head_layout=layout, kv_cache_memory=1 << 24, max_num_batched_tokens=7,
                  window_positions="rebased", max_num_seqs=seqs, kv_cache_dtype=kv)
        with torch.no_grad():
            ref = dense_reference_logits(llm, ids, rebased=True, kv_round=rt)
            plain = dense_reference_logits(llm, ids, kv_round=rt)
        assert (ref - plain).abs().max().item() > 1e-3  # re-basing changes the scores
        got = llm.engine.prompt_logits(ids, chunk_size=7)
        assert (got - ref).abs().max().item() < 2e-4
        out = llm.generate([ids], SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0))[0]
        with torch.no_grad():
            ref = dense_reference_logits(llm, ids + out.token_ids, rebased=True, kv_round=rt)
        ref_lp = torch.log_softmax(ref, -1)
        for t, tok in enumerate(out.token_ids):
            row = len(ids) - 1 + t
            assert tok == int(ref[row].argmax())
            assert abs(out.logprobs[t] - float(ref_lp[row, tok])) < 2e-4


def test_full_layout_equals_window_layout_with_large_window(tiny_models):
    """Ring storage with a window longer than the sequence computes full attention."""
    path = str(tiny_models["llama"])
    full = LLM(path, head_layout="full", kv_cache_memory=1 << 24)
    shape = full.layout.shape
    wide = LLM(path, head_layout=HeadLayout.window(shape, sink=4, window=256), kv_cache_memory=1 << 24)
    ids = full.tokenizer.encode("Bridges and rivers. " * 10)
    a = full.engine.prompt_logits(ids)
    b = wide.engine.prompt_logits(ids, chunk_size=9)
    assert (a - b).abs().max().item() < 1e-5
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    assert full.generate([ids], p)[0].token_ids == wide.generate([ids], p)[0].token_ids


def test_triton_backend_equals_torch_backend_batched(tiny_models):
    """The Triton engine path (block tables, split decode, ring kernels) gives the torch
    path's tokens for ragged prompts run together, and each prompt run alone."""
    path = str(tiny_models["llama"])
    probe = LLM(path, head_layout="full", kv_cache_memory=1 << 24)
    layout = mixed_layout(probe.layout.shape)
    torch_llm = LLM(path, head_layout=layout, kv_cache_memory=1 << 24, max_num_batched_tokens=16)
    tri = LLM(path, head_layout=layout, kv_cache_memory=1 << 24, max_num_batched_tokens=16,
              **backend_options("triton"))
    prompts = [tri.tokenizer.encode(t) for t in ("Rivers and bridges. " * 5, "Towns", "A road " * 9)]
    p = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0)
    want = torch_llm.generate(prompts, p, use_tqdm=False)
    got = tri.generate(prompts, p, use_tqdm=False)
    for w, g in zip(want, got):
        assert w.token_ids == g.token_ids
        assert max(abs(x - y) for x, y in zip(w.logprobs, g.logprobs)) < 1e-4
    assert_batched_equals_single(tri, prompts, p)


def test_ring_slot_mapping():
    from headwise.layers.window_geometry import ring_index, ring_positions

    slots = ring_index(torch.arange(12), 3, 4).tolist()
    assert slots == [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 3]
    # after 10 tokens: sink 0..2, recent 6..9 in slots 3..6 as 7, 8, 9, 6
    assert ring_positions(3, 4, 10).tolist() == [0, 1, 2, 7, 8, 9, 6]
    assert ring_positions(3, 4, 2).tolist() == [0, 1, -1, -1, -1, -1, -1]
    assert ring_positions(3, 4, 5).tolist() == [0, 1, 2, 3, 4, -1, -1]


def test_layout_roundtrip_and_shape_check(tmp_path):
    layout = mixed_layout((3, 2, 16))
    f = tmp_path / "l.json"
    layout.save(f)
    back = HeadLayout.load(f)
    assert back.heads == layout.heads and back.shape == layout.shape
    with pytest.raises(LayoutError, match=r"\(3, 2, 16\).*\(2, 2, 16\)"):
        back.check_shape(2, 2, 16)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(num_layers=5), "expected 5 x 2"),
    (lambda d: d["heads"][0].__setitem__(0, "sparse"), "unknown head class 'sparse'"),
    (lambda d: d["heads"][1].__setitem__(1, {"class": "window", "window": 0}), "window must be an integer >= 1"),
    (lambda d: d.update(version=9), "unsupported layout version 9"),
    (lambda d: d.pop("heads"), "missing or invalid field"),
])
def test_bad_layout_files(tmp_path, mutate, message):
    d = HeadLayout.window((3, 2, 16)).to_dict()
    mutate(d)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    with pytest.raises(LayoutError, match=message):
        HeadLayout.load(f)


def test_malformed_json_and_missing_file(tmp_path):
    f = tmp_path / "broken.json"
    f.write_text("{not json")
    with pytest.raises(LayoutError, match="not valid JSON"):
        HeadLayout.load(f)
    with pytest.raises(LayoutError, match="does not exist"):
        HeadLayout.load(tmp_path / "nope.json")


def test_engine_rejects_layout_for_other_model(tiny_models, tmp_path):
    f = tmp_path / "other.json"
    HeadLayout.window((30, 3, 64), model="SmolLM2-135M-Instruct").save(f)
    with pytest.raises(LayoutError, match="SmolLM2"):
        LLM(str(tiny_models["llama"]), head_layout=str(f))


@pytest.mark.parametrize("max_num_seqs", [4, 16])  # ring attended in place (2B >= S) / gathered
def test_batched_mixed_layout_equals_one_by_one(tiny_models, max_num_seqs):
    path = str(tiny_models["llama"])
    shape = LLM(path, head_layout="full", kv_cache_memory=1 << 24).layout.shape
    llm = LLM(path, head_layout=mixed_layout(shape), kv_cache_memory=1 << 24, max_num_seqs=max_num_seqs,
              block_size=4)
    prompts = ["Rivers and bridges " * k + str(k) for k in (1, 3, 5, 7)]
    # interleaved block appends leave each sequence's table in several runs
    assert_batched_equals_single(llm, prompts, SamplingParams(max_tokens=30, ignore_eos=True, logprobs=0))


def test_slot_runs_follow_block_table():
    from headwise.cache.block_pool import BlockPool
    from headwise.cache.paged_pool import PagedPool

    pool = PagedPool(BlockPool(8), 4, block_bytes=64)
    pool.allocate(1, 8)   # blocks 0, 1
    pool.allocate(2, 4)   # block 2
    pool.append(1, 13)    # blocks 3, 4 -> run [0, 1] then [3, 4]
    assert pool.tables[1] == [0, 1, 3, 4]
    assert pool.slot_runs(1, 13) == [(0, 8), (12, 5)]
    assert pool.slot_runs(1, 6) == [(0, 6)]


@pytest.mark.parametrize("sink, window, start, c", [
    (4, 8, 0, 37), (4, 8, 0, 12), (4, 8, 0, 13), (4, 8, 0, 17), (4, 8, 2, 30), (4, 8, 6, 30), (4, 8, 11, 23), (4, 8, 40, 17),
    (0, 8, 0, 29), (0, 8, 19, 9), (3, 1, 0, 12), (3, 1, 9, 5), (6, 16, 0, 5), (6, 16, 50, 1),
])
@pytest.mark.parametrize("rebased, kv_dtype", [(False, None), (True, None), (False, torch.int8)])
def test_window_prefill_matches_dense_mask(sink, window, start, c, rebased, kv_dtype):
    """The window prefill (causal prefix of a first chunk, then band + sinks over many
    query blocks of size 4, earlier context read from the ring) against a dense masked
    softmax over every position. int8: the ring holds quantized K/V, and the reference
    attends over the same quantized-then-dequantized K/V."""
    from headwise.heads import window as window_class
    from headwise.layers.attention import HeadGroup
    from headwise.layers.context import PrefillChunk, StepContext
    from headwise.layers.kv_tensor import KVTensor, take
    from headwise.layers.window_geometry import ring_index, window_chunk

    torch.manual_seed(start * 100 + c)
    n, g, D = 2, 3, 8
    T = start + c
    q = torch.randn(T, n * g, D)
    q_sink = None
    if rebased and sink:  # the re-based query differs only where delta = p - (sink + window - 1) > 0
        q_sink = torch.where((torch.arange(T) < sink + window)[:, None, None], q, torch.randn(T, n * g, D))
    k, v = torch.randn(T, n, D), torch.randn(T, n, D)
    R = sink + window

    def ring() -> KVTensor:  # junk where unwritten
        if kv_dtype is None:
            return KVTensor(torch.randn(2, n, R, D), None, torch.float32)
        return KVTensor(torch.randint(-127, 128, (2, n, R, D), dtype=kv_dtype), torch.rand(2, n, R), torch.float32)

    k_ring, v_ring = ring(), ring()
    wg = HeadGroup(window_class.WINDOW, 0, n, sink, window, k_ring, v_ring)
    kst, vst = k_ring.encode(k), v_ring.encode(v)  # as the layer does: encoded once
    k, v = k_ring.decode(*kst), v_ring.decode(*vst)  # what the layer hands the backend
    for p in range(start):  # what earlier chunks left in ring slot 1
        r = int(ring_index(torch.tensor(p), sink, window))
        k_ring.put((1, slice(None), r), *take(kst, lambda t: t[p]))
        v_ring.put((1, slice(None), r), *take(vst, lambda t: t[p]))
    ch = PrefillChunk(0, start, c, 1)
    ch.window[wg.ring_kind] = geo = window_chunk(start, c, sink, window, g, q.dtype, "cpu",
                                                   for_kernels=False, block=4)
    # no band masks when every row is in the causal prefix
    assert (geo.masks is None) == (start == 0 and c <= sink + window)
    ctx = StepContext(positions=torch.arange(start, T), full_slots=torch.zeros(c, dtype=torch.int64))
    qs = None if q_sink is None else q_sink[start:]
    got = window_class.torch_prefill(q[start:], k[start:], v[start:], wg, ctx, ch, qs, D ** -0.5)

    i = torch.arange(start, T)[:, None]
    j = torch.arange(T)[None, :]
    mask = (j <= i) & ((j < sink) | (j > i - window))
    for h in range(n * g):
        s = q[start:, h] @ k[:, h // g].T
        if q_sink is not None:
            s = torch.where(j < sink, q_sink[start:, h] @ k[:, h // g].T, s)
        s = (s * D ** -0.5).masked_fill(~mask, float("-inf"))
        ref = torch.softmax(s, -1) @ v[:, h // g]
        assert (got[:, h] - ref).abs().max().item() < 1e-5, h


@pytest.mark.parametrize("fused", [True, False])
def test_attend_returns_log_sum_exp(fused):
    from headwise.layers.torch_attention import attend as _attend
    from headwise.layers.window_geometry import bias as _bias

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    mask = torch.rand(1, 1, 5, 7) > 0.4
    mask[..., 0] = True
    o, lse = _attend(q, k, v, _bias(mask, q.dtype), 0.3, fused=fused)
    s = ((q @ k.transpose(-1, -2)) * 0.3).masked_fill(~mask, float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-5)
    assert torch.allclose(o, torch.softmax(s, -1) @ v, atol=1e-5)


@pytest.mark.parametrize("n,g,runs", [(1, 4, [5000]), (2, 3, [2048]), (3, 1, [4099]), (1, 2, [100]),
                                      (1, 4, [7, 3000, 16, 2500]), (2, 2, [16] * 40)])
def test_split_decode_attention_equals_one_pass(n, g, runs):
    """Decode over a cache held in runs of slots, each run attended on its own (long ones
    in pieces) and merged by log-sum-exp (split_attention), equals attending the whole
    cache in one pass, in float32 and in bfloat16."""
    import torch.nn.functional as F

    from headwise.heads.full import split_attention

    gen = torch.Generator().manual_seed(sum(runs))
    L = sum(runs)
    q, k, v = (torch.randn(*shape, 64, generator=gen) for shape in ((n, g), (n, L), (n, L)))
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=0.1)[0]
    cuts = torch.tensor([0] + runs).cumsum(0).tolist()
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        parts = [(k[:, a:b].to(dt), v[:, a:b].to(dt)) for a, b in zip(cuts, cuts[1:])]
        got = split_attention(q.to(dt), parts, 0.1).float()
        assert (got - ref).abs().max().item() < tol


@pytest.mark.parametrize("n,g,c,start,D", [(2, 7, 37, 100, 64), (3, 3, 16, 16, 64), (1, 4, 5, 300, 256),
                                           (8, 1, 64, 1, 32)])
def test_later_prefill_chunk_equals_masked_attention(n, g, c, start, D):
    """A full-head prefill chunk after the first (earlier positions unmasked and its own
    causally, merged by log-sum-exp) equals one masked attention over every position up
    to it, computed in float64, in float32 and in bfloat16."""
    import torch.nn.functional as F

    from headwise.heads.full import _later_chunk

    gen = torch.Generator().manual_seed(start + c)
    q = torch.randn(c, n * g, D, generator=gen)
    k, v = (torch.randn(c, n, D, generator=gen) for _ in range(2))
    kp, vp = (torch.randn(n, start, D, generator=gen) for _ in range(2))
    kk = torch.cat([kp, k.transpose(0, 1)], 1)[None].double()
    vv = torch.cat([vp, v.transpose(0, 1)], 1)[None].double()
    mask = torch.arange(start + c)[None] <= torch.arange(start, start + c)[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None].double(), kk, vv, attn_mask=mask, scale=0.1,
                                         enable_gqa=True)[0].transpose(0, 1)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        got = _later_chunk(q.to(dt), k.to(dt), v.to(dt), kp.to(dt), vp.to(dt), 0.1)
        assert got.shape == q.shape and got.dtype == dt
        assert (got.double() - ref).abs().max().item() < tol


# (layers, KV heads, head dim) of the models the shipped layout files name, from their
# model cards; a file made for another model, or damaged, fails here before a user loads it.
MODEL_SHAPES = {"SmolLM2-135M-Instruct": (30, 3, 64), "gemma-3-270m": (18, 1, 256),
                "Qwen2.5-Coder-0.5B-Instruct": (24, 2, 64), "Qwen2.5-Coder-1.5B-Instruct": (28, 2, 128)}


def test_every_layout_file_shipped_loads_with_its_models_shape():
    files = sorted(_DIR.glob("*.json"))
    assert len(files) >= 20
    for f in files:
        layout = HeadLayout.load(f)
        assert layout.shape == MODEL_SHAPES[layout.model], f.name
        model = layout.model.lower().removesuffix("-instruct")
        assert f.name.startswith(model), f.name


def test_each_models_shipped_layout_is_the_file_named_for_it():
    # A known model runs with the layout SHIPPED names for it: the file must exist, say it
    # was calibrated for that model, and be returned only for that model's shape.
    for table, select in ((SHIPPED, False), (SHIPPED_SELECT, True)):
        for model, fname in table.items():
            want = HeadLayout.load(_DIR / fname)
            assert want.model == model, fname
            got = shipped_layout(model, MODEL_SHAPES[model], select=select)
            assert got is not None and got.name == want.name and got.heads == want.heads, fname
            assert 0 < got.full_fraction < 1, fname
            assert any(s.kind == "select" for row in got.heads for s in row) == select, fname
            layers, kv, dim = MODEL_SHAPES[model]
            assert shipped_layout(model, (layers + 1, kv, dim), select=select) is None
    assert shipped_layout("no-such-model", (30, 3, 64)) is None
