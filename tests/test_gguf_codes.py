"""GGUF block formats read as codes and scales (weights/gguf_codes.py, layers/quant.py):
the dense weight made from them is gguf's dequantized weight bit for bit; the decode
copies come from them without a search; head permutations move them with the weight; and
a lazily loaded model (no float32 copy) prepares to the same weights as an eager one; a
tensor read is released from resident memory and reads the same again."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from headwise.kernels import int8_matmul
from headwise.layers import embedding, int4, linear
from headwise.layers.quant import QuantCodes
from headwise.weights.gguf_codes import FORMATS, read_codes
from headwise.weights.gguf_file import GGUFFile
from headwise.weights.loader import default_model_path, load_model, load_weights

# where each format keeps its float16 fields (d, and dmin or m), by byte offset
F16_AT = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
          Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(n: int, k: int, qtype: Q, seed: int = 0) -> np.ndarray:
    """Raw rows [n, bytes] of `qtype`: random codes and scales, float16 fields of a
    realistic size and either sign (a negative m is a positive minimum's offset)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for a in F16_AT[qtype]:
        vals = (rng.random(len(raw)) * 1e-2 + 1e-5) * rng.choice([-1, 1], len(raw))
        raw[:, a:a + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_codes_make_ggufs_dequantized_weight_bit_for_bit(qtype):
    raw = random_blocks(48, 512, qtype)
    q = read_codes(raw, qtype)
    ref = torch.from_numpy(np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32))
    assert q.shape == (48, 512)
    assert torch.equal(q.dense().view(torch.int32), ref.view(torch.int32))
    assert torch.equal(q.dense(torch.bfloat16), ref.bfloat16())  # rounded once, from float32
    group, levels = FORMATS[qtype][1:]
    assert q.group == group and q.levels == levels
    lo, hi = (0, levels - 1) if q.lows is not None else (-levels // 2, levels // 2 - 1)
    assert int(q.codes.min()) >= lo and int(q.codes.max()) <= hi


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_decode_copies_reproduce_the_weight(qtype):
    raw = random_blocks(32, 256, qtype, seed=1)
    q = read_codes(raw, qtype)
    w = q.dense()
    four = q.int4()
    if levels_4bit := q.levels <= 16:
        codes, scales, lows = four
        assert codes.dtype == torch.int8 and 0 <= int(codes.min()) and int(codes.max()) <= 15
        back = lows.repeat_interleave(32, 1) + codes * scales.repeat_interleave(32, 1)
        torch.testing.assert_close(back, w, rtol=1e-6, atol=0)
    else:
        assert four is None
    eight = q.int8()
    codes, scales, lows = eight
    back = codes.float() * scales.repeat_interleave(q.group, 1)
    if lows is not None:
        back += lows.repeat_interleave(q.group, 1)
    assert torch.equal(back, w)
    assert levels_4bit == (qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K))


def test_int4_needs_rows_the_kernel_packs():
    assert read_codes(random_blocks(24, 64, Q.Q4_1), Q.Q4_1).int4() is None  # 24 % 16
    assert read_codes(random_blocks(32, 64, Q.Q4_1), Q.Q4_1).int4() is not None


def test_unread_types_are_left_to_the_dequantizer():
    assert read_codes(np.zeros((2, 84), np.uint8), Q.Q2_K) is None
    assert read_codes(np.zeros((2, 8), np.uint8), Q.F32) is None


def test_head_permutations_move_codes_with_the_weight():
    q = read_codes(random_blocks(64, 256, Q.Q4_K, seed=2), Q.Q4_K)
    w = q.dense()
    rows = torch.randperm(64)
    assert torch.equal(q.take_rows(rows).dense(), w[rows])
    heads = torch.cat([torch.arange(h * 64, (h + 1) * 64) for h in (2, 0, 3, 1)])  # head_dim 64
    assert torch.equal(q.take_columns(heads).dense(), w[:, heads])
    assert q.take_columns(torch.cat([torch.arange(16, 256), torch.arange(16)])) is None  # splits groups
    six = read_codes(random_blocks(16, 256, Q.Q6_K), Q.Q6_K)  # groups of 16
    assert torch.equal(six.take_columns(heads).dense(), six.dense()[:, heads])
    both = QuantCodes.cat_rows([q, q.take_rows(rows)])
    assert torch.equal(both.dense(), torch.cat([w, w[rows]]))
    assert QuantCodes.cat_rows([q, read_codes(random_blocks(64, 256, Q.Q4_0), Q.Q4_0)]) is None  # lows or not


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="quantized weight"):
        QuantCodes(torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 3), None, 32, 16)


def _resident_mib(path) -> float:
    """This process's resident MiB of mappings of `path` (/proc/self/smaps)."""
    total, ours = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # a mapping's header line
            ours = line.rstrip().endswith(str(path))
        elif ours and head[0] == "Rss:":
            total += int(head[1])
    return total / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_released_tensors_leave_resident_memory_and_read_again_alike():
    path = default_model_path().resolve()
    reader = GGUFFile(path)
    big = [t for t in reader.tensors if t.data.nbytes > 1 << 20]
    before = [t.data.copy() for t in big]  # every page of them faulted in
    touched = _resident_mib(path)
    assert touched > sum(t.data.nbytes for t in big) / 2**20 * 0.9
    assert all(reader.release(t) for t in big)
    assert _resident_mib(path) < touched - sum(t.data.nbytes for t in big) / 2**20 * 0.9
    assert all(np.array_equal(t.data, b) for t, b in zip(big, before))  # faulted in again from the file
    with pytest.raises(ValueError, match="is not one of"):
        reader.release(GGUFFile(path).tensors[0])


@pytest.mark.parametrize("dense", [False, True])
def test_codes_only_preparing_lets_go_of_each_layers_codes_once_packed(dense, monkeypatch):
    """Kept as codes only, a fusion's parts drop the file's int8 codes as soon as the
    fusion has packed them, so no later fusion is made while an earlier one's parts still
    hold theirs (a cold start would hold the model both ways). With dense copies the parts
    keep their codes until each dense weight is made from them."""
    model = load_weights(None, torch.float32, lazy=True)
    made, held = [], []
    real = linear.FusedInt4.__init__

    def watched(self, parts):
        held.append(sum(p.quant is not None for f in made for p in f.parts))
        real(self, parts)
        made.append(self)

    monkeypatch.setattr(linear.FusedInt4, "__init__", watched)
    model.prepare_weights(torch.bfloat16, dense=dense)
    assert len(made) == 2 * model.config.num_layers and all(f.int4 is not None for f in made)
    assert (held == [0] * len(made)) != dense
    assert all(f.codes_only != dense for f in made)


def test_default_model_prepares_from_codes_without_searching(monkeypatch):
    """Every quantized weight of the default GGUF (Q4_1 projections, a Q8_0 tied
    embedding) gets its decode copy from the file's codes: the searches would fail the
    test. Lazy and eager loads prepare to the same packed weights and copies."""
    def no_search(*a, **k):
        raise AssertionError("searched for codes the file stores")

    eager, _ = load_model(None, torch.float32)
    eager.prepare_weights(torch.bfloat16)
    for name in ("exact_affine", "exact_int8"):
        monkeypatch.setattr(int8_matmul, name, no_search)
    monkeypatch.setattr(int4, "exact_affine", no_search)
    monkeypatch.setattr(linear, "int8_copy", no_search)
    monkeypatch.setattr(embedding, "int8_copy", no_search)
    lazy, _ = load_model(None, torch.float32, lazy=True)
    assert lazy.model.layers[0].mlp.up_proj.weight is None  # no dense weight yet
    lazy.prepare_weights(torch.bfloat16)
    pairs = list(zip(eager.modules(), lazy.modules()))
    for a, b in pairs:
        if isinstance(a, linear.Linear):
            assert torch.equal(a.dense_weight(), b.dense_weight())
        for buf in ("int4_codes", "int4_scales", "int8_codes", "int8_scales", "int8_lows"):
            x, y = getattr(a, buf, None), getattr(b, buf, None)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
    fused = lazy.model.layers[0].self_attn.qkv_int4
    assert fused.int4 is not None and lazy.model.layers[0].self_attn.q_proj.int4 is None
    assert lazy.model.embed_tokens.int8_codes is not None and lazy.model.embed_tokens.weight is None
    # the file's 4-bit codes are the copy's, in the kernel's packing
    tensor = next(t for t in GGUFFile(default_model_path()).tensors if t.name == "blk.0.ffn_down.weight")
    codes, scales, lows = read_codes(tensor.data, tensor.qtype).int4()
    packed, sz = linear.int4_pack(codes, scales, lows)
    assert torch.equal(lazy.model.layers[0].mlp.down_proj.int4_codes, packed)
    assert torch.equal(lazy.model.layers[0].mlp.down_proj.int4_scales, sz.bfloat16())
