"""The causal prefill attention kernel (headwise/kernels/cpu_prefill.c) against attention
computed in float64, and the inputs it leaves to PyTorch."""
import pytest
import torch
import torch.nn.functional as F

from headwise.kernels import cpu_kernels

if cpu_kernels.prefill_library(amx_too=True) is None:
    pytest.skip("the prefill kernel needs AVX512-BF16 and a C compiler", allow_module_level=True)


def reference(q, k, v, start, scale):
    """q [c, H, D] at positions [start, start + c) over k, v [S, nkv, D], in float64."""
    c, S = q.shape[0], k.shape[0]
    mask = torch.arange(S)[None] <= torch.arange(start, start + c)[:, None]
    qq, kk, vv = (t.transpose(0, 1)[None].double() for t in (q, k, v))
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("H,nkv,D,c,start", [
    (14, 2, 64, 37, 100),   # GQA 7:1, rows not a whole block, keys not a whole block
    (9, 3, 64, 16, 0),      # SmolLM2's heads, a first chunk
    (4, 1, 256, 5, 300),    # Gemma 3's head size, fewer rows than one register block
    (8, 8, 64, 64, 1),      # no grouping
    (12, 2, 128, 200, 77),  # Qwen2.5-Coder-1.5B's heads
    (2, 1, 64, 1, 0),       # one token
    (3, 1, 256, 130, 1000),
])
def test_kernel_equals_attention(H, nkv, D, c, start):
    """Within the error of PyTorch's own bfloat16 attention of the same inputs (both against
    float64), and within bfloat16 rounding of the float64 result."""
    gen = torch.Generator().manual_seed(H * 1000 + c + start)
    S = start + c
    q = torch.randn(c, H, D, generator=gen).bfloat16()
    k, v = (torch.randn(S, nkv, D, generator=gen).bfloat16() for _ in range(2))
    got = cpu_kernels.prefill_attention(q, k, v, start, D ** -0.5, amx_too=True)
    ref = reference(q, k, v, start, D ** -0.5)
    mask = torch.arange(S)[None] <= torch.arange(start, start + c)[:, None]
    theirs = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                            attn_mask=mask, scale=D ** -0.5, enable_gqa=True)[0].transpose(0, 1)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    err, their_err = (got.double() - ref).abs().max().item(), (theirs.double() - ref).abs().max().item()
    assert err <= max(1.5 * their_err, 1e-2), (err, their_err)


def test_kernel_reads_strided_keys_and_large_scores():
    """Keys and values as a transposed view of [nkv, S, D] (how the pool hands them over),
    and scores large enough that the running max changes block after block."""
    gen = torch.Generator().manual_seed(7)
    c, start, H, nkv, D = 50, 150, 4, 2, 64
    S = start + c
    q = (4 * torch.randn(c, H, D, generator=gen)).bfloat16()
    k_heads = (4 * torch.randn(nkv, S, D, generator=gen)).bfloat16()
    k_heads[:, 120] *= 8  # one key far above the rest, met in the second block
    v_heads = torch.randn(nkv, S, D, generator=gen).bfloat16()
    k, v = k_heads.transpose(0, 1), v_heads.transpose(0, 1)  # [S, nkv, D], not contiguous
    got = cpu_kernels.prefill_attention(q, k, v, start, 0.125, amx_too=True)
    ref = reference(q, k, v, start, 0.125)
    assert (got.double() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("slope", [0.02, 0.1, 0.5])
def test_scores_rising_key_after_key(slope):
    """Scores that rise along the keys by `slope` each (1.3, 6.4 and 32 per 64-key block):
    the kernel's lazy running max stays put while a block passes it by little and moves
    when one passes it by more, and both give attention as computed in float64."""
    c, start, H, nkv, D = 40, 600, 2, 1, 64
    S = start + c
    gen = torch.Generator().manual_seed(11)
    q = torch.zeros(c, H, D)
    q[:, :, 0] = 1.0
    k = 0.05 * torch.randn(S, nkv, D, generator=gen)
    k[:, :, 0] = slope * torch.arange(S, dtype=torch.float32)[:, None] / 0.125  # score of key j: ~slope * j
    q, k = q.bfloat16(), k.bfloat16()
    v = torch.randn(S, nkv, D, generator=gen).bfloat16()
    got = cpu_kernels.prefill_attention(q, k, v, start, 0.125, amx_too=True).double()
    ref = reference(q, k, v, start, 0.125)
    assert (got - ref).abs().max().item() < 2e-2 * ref.abs().max().item() + 1e-2


def test_rows_after_the_first_ignore_later_keys():
    """Causality: changing the keys and values of positions after a row leaves that row's
    output as it was."""
    gen = torch.Generator().manual_seed(3)
    c, start, H, D = 70, 10, 2, 64
    q = torch.randn(c, H, D, generator=gen).bfloat16()
    k, v = (torch.randn(start + c, 1, D, generator=gen).bfloat16() for _ in range(2))
    a = cpu_kernels.prefill_attention(q, k, v, start, 0.125, amx_too=True)
    k2, v2 = k.clone(), v.clone()
    k2[start + 40:] = 9.0
    v2[start + 40:] = -9.0
    b = cpu_kernels.prefill_attention(q, k2, v2, start, 0.125, amx_too=True)
    assert torch.equal(a[:40], b[:40])  # rows 0..39 see positions up to start + 39
    assert not torch.equal(a[40:], b[40:])


def test_keys_and_values_of_different_layouts():
    """A step's K rotated apart from its V (the fused 4-bit q/k/v of a model kept as codes
    only: V a view of the fused output, K a tensor of its own) is still attended by the
    kernel, not left to PyTorch."""
    gen = torch.Generator().manual_seed(11)
    c, H, nkv, D = 40, 6, 2, 64
    qkv = torch.randn(c, H + 2 * nkv, D, generator=gen).bfloat16()
    q, v = qkv[:, :H], qkv[:, H + nkv:]
    k = torch.randn(c, nkv, D, generator=gen).bfloat16()
    assert k.stride() != v.stride()
    got = cpu_kernels.prefill_attention(q, k, v, 0, 0.125, amx_too=True)
    assert got is not None
    assert torch.equal(got, cpu_kernels.prefill_attention(q.contiguous(), k, v.contiguous(), 0, 0.125, amx_too=True))


@pytest.mark.parametrize("change", ["float32", "head size 32", "head size 320", "heads not grouped"])
def test_inputs_left_to_pytorch(change):
    """The kernel declines (None) what it was not written for, and the caller keeps PyTorch's code."""
    c, H, nkv, D, start = 8, 4, 2, 64, 4
    dt, S = torch.bfloat16, start + c
    if change == "float32":
        dt = torch.float32
    elif change == "head size 32":
        D = 32
    elif change == "head size 320":
        D = 320
    else:
        H = 3
    q = torch.zeros(c, H, D, dtype=dt)
    k = v = torch.zeros(S, nkv, D, dtype=dt)
    assert cpu_kernels.prefill_attention(q, k, v, start, 0.125, amx_too=True) is None


@pytest.mark.parametrize("layout", ["full", "mixed"])
def test_engine_prefill_through_kernel_equals_pytorch(tmp_path, tokenizer_dir, monkeypatch, layout):
    """A bfloat16 engine (head size 64, grouped heads) prefilling a prompt in chunks, the
    first and every later one through the kernel (full heads; with `mixed`, window heads of
    sink 4 and window 40 too, whose bands reach back into earlier chunks), gives the logits
    PyTorch's attention gives, within bfloat16 rounding, and the same next token at nearly
    every position. The band masks of PyTorch's window path are built only where it runs."""
    from headwise import LLM
    from headwise.heads import full
    from headwise.layers import window_geometry
    from headwise.heads.layout import HeadLayout, HeadSpec
    from tests.conftest import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "d64", tokenizer_dir, hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=2)
    if layout == "mixed":  # per layer, one KV head full and one window
        layout = HeadLayout("mixed", 2, 2, 64, [[HeadSpec("full"), HeadSpec("window", 4, 40)]] * 2)
    llm = LLM(str(path), head_layout=layout, kv_cache_memory=1 << 24, dtype="bfloat16")
    ids = list(range(5, 205))
    kernel, library = cpu_kernels.prefill_attention, cpu_kernels.prefill_library
    monkeypatch.setattr(cpu_kernels, "prefill_library", lambda amx_too=False: library(True))  # AMX CPUs too
    calls = []
    monkeypatch.setattr(full.cpu_kernels, "prefill_attention",
                        lambda *a, **kw: calls.append((a[3], kw.get("window"))) or kernel(*a, amx_too=True, **kw))
    built, band_masks = [], window_geometry.band_masks
    monkeypatch.setattr(window_geometry, "band_masks", lambda *a: built.append(a[0]) or band_masks(*a))
    got = llm.engine.prompt_logits(ids, chunk_size=64).float()
    windows = [None] if layout == "full" else [None, 40]
    assert sorted(set(calls), key=str) == sorted({(s, w) for s in (0, 64, 128, 192) for w in windows}, key=str)
    assert built == []
    monkeypatch.setattr(full.cpu_kernels, "prefill_attention", lambda *a, **kw: None)
    ref = llm.engine.prompt_logits(ids, chunk_size=64).float()
    assert sorted(set(built)) == ([] if windows == [None] else [0, 64, 128, 192])
    assert (got - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95


def test_keys_that_miss_a_query_are_an_error():
    """Keys that do not reach the last query's own position are a caller's mistake, not a
    case for PyTorch: a clear error."""
    q = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(11, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not hold"):
        cpu_kernels.prefill_attention(q, k, k, 4, 0.125, amx_too=True)
    with pytest.raises(ValueError, match="do not hold"):  # sinks past the band's start
        cpu_kernels.prefill_attention(q, k, k, 4, 0.125, window=2, sink=4, sinks_given=3, band_pos=2, amx_too=True)


def window_reference(q, k, v, start, scale, window, sink, sinks_given, band_pos):
    """float64 attention where a query at position p sees keys at (p - window, p] and below
    `sink` up to p; key j is position j below sinks_given, else band_pos + j - sinks_given."""
    c, S = q.shape[0], k.shape[0]
    j = torch.arange(S)
    kpos = torch.where(j < sinks_given, j, band_pos + j - sinks_given)
    p = torch.arange(start, start + c)[:, None]
    mask = (kpos[None] <= p) & ((kpos[None] > p - window) | (kpos[None] < sink))
    qq, kk, vv = (t.transpose(0, 1)[None].double() for t in (q, k, v))
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("c,start,window,sink", [
    (300, 0, 64, 4),      # a first chunk: causal rows, then the band with its sinks
    (300, 0, 1000, 64),   # a window longer than the chunk: plain causal attention
    (130, 500, 100, 64),  # a later chunk: sinks given apart, the band read from before it
    (130, 500, 100, 0),   # no sinks
    (70, 90, 50, 64),     # the band starts below the sink count: sinks partly inside it
    (5, 1000, 256, 16),   # fewer rows than one register block
])
def test_window_and_sinks_equal_masked_attention(c, start, window, sink):
    """Window heads' prefill: the keys a window head keeps (its sinks apart, then the band
    of positions from start - window on), as heads/window.py hands them over."""
    H, nkv, D = 14, 2, 64
    band_pos = max(0, start - window)
    sinks_given = min(sink, band_pos)
    S = sinks_given + start + c - band_pos
    gen = torch.Generator().manual_seed(c + start + window + sink)
    q = torch.randn(c, H, D, generator=gen).bfloat16()
    k, v = (torch.randn(S, nkv, D, generator=gen).bfloat16() for _ in range(2))
    got = cpu_kernels.prefill_attention(q, k, v, start, D ** -0.5, window=window, sink=sink,
                                        sinks_given=sinks_given, band_pos=band_pos, amx_too=True)
    ref = window_reference(q, k, v, start, D ** -0.5, window, sink, sinks_given, band_pos)
    assert (got.double() - ref).abs().max().item() < 1.5e-2
