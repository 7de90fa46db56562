"""A head class is one module: this file defines a third class, registers it, and runs
the engine end to end with it beside `full` and `window` heads, against a dense masked
reference. Nothing outside the class below knows it exists."""
import pytest
import torch
import torch.nn.functional as F

from headwise import LLM, HeadLayout, SamplingParams
from headwise.heads import base
from headwise.heads.layout import HeadSpec, LayoutError
from headwise.layers.kv_tensor import take
from tests.test_head_split import dense_reference_logits


class SinkHeads(base.HeadClass):
    """Keeps only the first `sink` tokens: each query attends them and itself. Its ring
    holds the sinks in entries [0, sink) and the newest token in entry `sink`."""
    name = "sinks-test"
    storage = base.RING
    params = ("sink",)

    def check(self, spec) -> None:
        if not isinstance(spec.sink, int) or spec.sink < 1:
            raise LayoutError(f"sink must be an integer >= 1, got {spec.sink!r}")

    def ring_size(self, spec) -> int:
        return spec.sink + 1

    def describe(self, spec) -> str:
        return f"sinks-test (sink {spec.sink})"

    def ring_index(self, pos, sink, window):
        return pos.clamp(max=sink)

    def ring_writes(self, start, length, sink, window, device):
        pos = torch.arange(start, start + length, device=device)
        rows = ((pos < sink) | (pos == start + length - 1)).nonzero().squeeze(1)
        return rows, pos[rows].clamp(max=sink)

    def attend(self, layer, group, ctx, q, kst, vst, out) -> None:
        kind, n = group.ring_kind, group.num_heads
        g, D, sink = q.shape[1] // n, q.shape[2], group.sink
        B = ctx.num_decode
        if B:
            at = (ctx.decode_ring_slots, slice(None), ctx.decode_ring_index[kind])
            group.k.put(at, *take(kst, lambda t: t[:B]))
            group.v.put(at, *take(vst, lambda t: t[:B]))
            for i, (p, slot) in enumerate(zip(ctx.positions[:B].tolist(), ctx.decode_ring_slots.tolist())):
                # entries [0, min(p, sink)) and the token itself
                m = min(p + 1, sink + 1)
                kk = group.k.load((slot, slice(None), slice(0, m)))  # [n, m, D]
                vv = group.v.load((slot, slice(None), slice(0, m)))
                o = F.scaled_dot_product_attention(q[i].view(n, g, D), kk, vv, scale=layer.scale)
                out[i] = o.reshape(n * g, D)
        if not ctx.prefills:
            return
        k, v = group.k.decode(*kst), group.v.decode(*vst)
        for ch in ctx.prefills:
            s, start, c = ch.rows, ch.start, ch.length
            ns = min(sink, start)  # sinks before the chunk are in the ring
            kk = torch.cat((group.k.load((ch.ring_slot, slice(None), slice(0, ns))), k[s].transpose(0, 1)), 1)
            vv = torch.cat((group.v.load((ch.ring_slot, slice(None), slice(0, ns))), v[s].transpose(0, 1)), 1)
            kpos = torch.cat((torch.arange(ns), torch.arange(start, start + c)))
            qpos = torch.arange(start, start + c)
            mask = ((kpos[None] < sink) & (kpos[None] <= qpos[:, None])) | (kpos[None] == qpos[:, None])
            o = F.scaled_dot_product_attention(q[s].transpose(0, 1)[None], kk[None], vv[None], attn_mask=mask,
                                               scale=layer.scale, enable_gqa=True)  # [1, n*g, c, D]
            out[s] = o[0].transpose(0, 1)
            rows, index = self.ring_writes(start, c, sink, 0, q.device)
            group.k.put((ch.ring_slot, slice(None), index), *take(kst, lambda t: t[s][rows].transpose(0, 1)))
            group.v.put((ch.ring_slot, slice(None), index), *take(vst, lambda t: t[s][rows].transpose(0, 1)))
            for slot, writes in ch.snapshots:  # states at prefix-cache points inside the chunk
                rows, index = writes[kind]
                group.k.put((slot, slice(None), index), *take(kst, lambda t: t[s][rows].transpose(0, 1)))
                group.v.put((slot, slice(None), index), *take(vst, lambda t: t[s][rows].transpose(0, 1)))


SINK = 3
MASKS = {"sinks-test": lambda spec, i, j: (j < spec.sink) | (j == i)}


@pytest.fixture
def sink_class():
    base.register(SinkHeads())
    yield
    base.unregister("sinks-test")


def three_class_layout(shape) -> HeadLayout:
    L, H, D = shape
    cycle = [HeadSpec("full"), HeadSpec("window", 2, 6), HeadSpec("sinks-test", SINK)]
    return HeadLayout("three", L, H, D, [[cycle[(l + h) % 3] for h in range(H)] for l in range(L)])


def test_unregistered_class_is_refused(tmp_path):
    with pytest.raises(LayoutError, match="unknown head class 'sinks-test'"):
        HeadSpec("sinks-test", SINK)


def test_layout_files_name_the_new_class(sink_class, tmp_path):
    lay = three_class_layout((3, 2, 8))
    lay.save(tmp_path / "l.json")
    again = HeadLayout.load(tmp_path / "l.json")
    assert again.heads == lay.heads and str(again.heads[1][1]) == "sinks-test (sink 3)"
    with pytest.raises(LayoutError, match="sink must be an integer >= 1"):
        HeadSpec("sinks-test", 0)


@pytest.mark.parametrize("caching", [False, True])
def test_engine_runs_a_class_defined_here_against_a_dense_reference(sink_class, tiny_models, caching):
    path = str(tiny_models["llama"])
    probe = LLM(path, head_layout="full", kv_cache_memory=1 << 24)
    layout = three_class_layout(probe.layout.shape)
    assert {s.kind for row in layout.heads for s in row} == {"full", "window", "sinks-test"}
    llm = LLM(path, head_layout=layout, kv_cache_memory=1 << 24, max_num_batched_tokens=7,
              enable_prefix_caching=caching)
    ids = llm.tokenizer.encode("A long prompt about rivers, towns and bridges, " * 3)
    with torch.no_grad():
        ref = dense_reference_logits(llm, ids, masks=MASKS)
    for chunk in (len(ids), 7):  # one pass, and chunks that start past the sinks
        got = llm.engine.prompt_logits(ids, chunk_size=chunk)
        assert (got - ref).abs().max().item() < 1e-4
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0)
    out = llm.generate([ids], params)[0]
    full_ids = ids + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(dense_reference_logits(llm, full_ids, masks=MASKS), -1)
    for t, tok in enumerate(out.token_ids):
        row = len(ids) - 1 + t
        assert tok == int(ref[row].argmax()) and abs(out.logprobs[t] - float(ref[row, tok])) < 1e-4
    # Two sequences at once (batched decode), one of them after the other's prompt:
    # with caching on, its prompt comes from the prefix cache, the new class's ring too.
    again = llm.generate([ids, ids[:-5]], params)
    assert again[0].token_ids == out.token_ids
    short = ids[:-5] + again[1].token_ids
    with torch.no_grad():
        ref = dense_reference_logits(llm, short, masks=MASKS)
    assert again[1].token_ids == ref[len(ids) - 6:-1].argmax(-1).tolist()
    # Its ring counts in the KV bytes: sink + 1 tokens per head, whatever the length.
    geo = llm.engine.cache.geometry
    assert geo.ring_tokens == sum(s.ring_size for row in layout.heads for s in row)
