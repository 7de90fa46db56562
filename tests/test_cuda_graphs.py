"""Decode replayed from CUDA graphs (engine.cuda_graphs).

On a CUDA machine these tests capture real graphs. Elsewhere the Triton kernels run in
Triton's interpreter and a graph is stood in for by ReplayCapturer, which keeps what makes
graphs hard to get right: a replay runs against the context and buffers of its capture
(the Python values of the step it was captured with, the tensors by address), and any read
of a tensor's value on the host fails, as it cannot happen inside a graph. A step input that
does not go through the persistent buffers, a padding row that writes over a sequence, or a
per-step Python value read by the kernels changes the tokens, and the tests see it."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from headwise import LLM, SamplingParams
from headwise.heads.layout import HeadLayout, HeadSpec
from headwise.engine import cuda_graphs
from headwise.kernels import pointwise
from headwise.layers.context import PagedDecode, PrefillChunk, StepContext, get_context, step_context
from tests.conftest import make_tiny_model
from tests.test_gemma3 import TINY as GEMMA

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# Prompts of different lengths and budgets: decode batches of 3 (bucket 4, one padding
# row), then 2, then 1, each sequence crossing block boundaries.
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time", "a b c d e f g h i j " * 2]
MAX_TOKENS = [14, 9, 5]


class HostRead(RuntimeError):
    pass


class NoHostReads(TorchDispatchMode):
    """Fails on the ops that read a tensor's value on the host (.item(), .tolist(),
    nonzero's output size): a CUDA graph replays without running Python."""
    SYNCING = {torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING:
            raise HostRead(f"{func} reads a tensor on the host inside a captured step")
        return func(*args, **(kwargs or {}))


class ReplayCapturer:
    """A CPU stand-in for cuda_graphs.CudaCapturer (see the module docstring)."""

    def __init__(self) -> None:
        self.replays: list[int] = []  # bucket of every replay

    def __call__(self, fn):
        captured = get_context()
        out = fn()

        def replay() -> None:
            self.replays.append(out.shape[0])
            with step_context(captured), NoHostReads(), torch.inference_mode():  # as captured
                out.copy_(fn())

        return replay, out


@pytest.fixture
def replay_capturer(monkeypatch):
    """Graphs as on CUDA; on the CPU, through ReplayCapturer, with norms and rotary in
    PyTorch as on CUDA (not the CPU kernels), so the host-read check covers that code."""
    if CUDA:
        return None
    cap = ReplayCapturer()
    monkeypatch.setattr(cuda_graphs, "capturer_for", lambda device: cap)
    monkeypatch.setattr(pointwise, "pointwise_library", lambda: None)
    return cap


def _mixed() -> HeadLayout:
    """Layer 0: a full head and a window head (sink 2, window 8); layer 1: window heads of
    another (sink, window), so two window kinds have ring entries per row."""
    spec = [[HeadSpec("full"), HeadSpec("window", 2, 8)], [HeadSpec("window", 1, 6), HeadSpec("window", 1, 6)]]
    return HeadLayout("mixed", 2, 2, 16, spec)


def _engine(path, layout, enforce_eager, kv="auto"):
    return LLM(path, head_layout=layout, kv_cache_memory=1 << 22, dtype="float32", block_size=4,
               attention_backend="triton", device=DEVICE, max_model_len=64, max_num_seqs=5,
               kv_cache_dtype=kv, enforce_eager=enforce_eager)


def _run(llm):
    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=0) for n in MAX_TOKENS]
    return llm.generate(PROMPTS, params, use_tqdm=False)


def test_capture_sizes():
    assert cuda_graphs.capture_sizes(1) == [1]
    assert cuda_graphs.capture_sizes(5) == [1, 2, 4, 5]
    assert cuda_graphs.capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert cuda_graphs.capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    top = cuda_graphs.capture_sizes(10_000)
    assert top[-1] == cuda_graphs.MAX_CAPTURE_SIZE and top == sorted(set(top))


@pytest.mark.parametrize("layout,kv,enforce_eager", [("full", "auto", None), ("mixed", "auto", None),
                                                    ("window", "auto", None), ("mixed", "int8", None),
                                                    ("mixed", "auto", False)])
def test_graph_decode_equals_eager_float32(tiny_models, replay_capturer, layout, kv, enforce_eager):
    """Every head class, quantized rings and pages; enforce_eager=False captures the
    torch.compile'd body."""
    path = str(tiny_models["llama"])
    lay = _mixed() if layout == "mixed" else layout
    eager = _engine(path, lay, True, kv)
    graphs = _engine(path, lay, enforce_eager, kv)
    assert eager.engine.runner.graphs is None
    g = graphs.engine.runner.graphs
    assert g.enabled and g.sizes == [1, 2, 4, 5] and g.capture_s > 0
    assert graphs.engine.runner.forward.enabled == (enforce_eager is False)
    want, got = _run(eager), _run(graphs)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    if replay_capturer is not None:  # decode at 3 sequences (bucket 4), 2 and 1 replayed
        assert {4, 2, 1} <= set(replay_capturer.replays)
    graphs.engine.cache.paged.blocks.check()
    # Padding rows wrote only into the spare block and ring slot, past the manager's books.
    assert graphs.engine.runner.kv.num_blocks == graphs.engine.cache.num_blocks + 1


def test_graph_decode_gemma3_equals_eager(tmp_path, tokenizer_dir, replay_capturer):
    """QK-norm, sandwich norms, scaled embeddings, two rotary bases and the native
    sliding-window layers as window heads."""
    path = str(make_tiny_model("gemma3", tmp_path / "g", tokenizer_dir, **GEMMA))
    want, got = _run(_engine(path, "native", True)), _run(_engine(path, "native", None))
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    if replay_capturer is not None:
        assert {4, 2, 1} <= set(replay_capturer.replays)


def test_padding_rows_are_the_spare_sequence():
    """Rows past a step's batch, up to its bucket, are a one-token sequence in the spare
    block and ring slot, whatever an earlier, larger step left in them."""
    kinds = [(2, 8)]
    seen = []

    def body(ids, pos):  # what the captured kernels read: the context's buffers
        ctx = get_context()
        seen.append((ids.clone(), pos.clone(), ctx.full_slots.clone(), ctx.decode_lens.clone(),
                     ctx.decode_ring_slots.clone(), ctx.decode_ring_index[(2, 8)].clone(),
                     ctx.decode.block_tables[:, 0].clone()))
        return ids.float()[:, None]

    shape = cuda_graphs.GraphShape(max_batch=4, max_blocks=3, block_size=4, ring_kinds=kinds, has_paged_heads=True,
                                   pad_block=9, pad_ring=7)
    g = cuda_graphs.CudaGraphDecode(body, ReplayCapturer(), torch.device("cpu"), shape)
    g.capture()

    def step(B):
        lens = torch.arange(B) + 6
        ctx = StepContext(positions=lens - 1, full_slots=torch.arange(B) * 4 + 1, block_size=4, num_decode=B,
                          decode_lens=lens, decode_ring_slots=torch.arange(B),
                          decode=PagedDecode(torch.arange(2 * B, dtype=torch.int32).view(B, 2)),
                          decode_ring_index={(2, 8): torch.arange(B) + 3})
        seen.clear()
        out = g.replay(ctx, torch.arange(B) + 100)
        assert out.shape == (B, 1) and out[:, 0].tolist() == list(range(100, 100 + B))
        return seen[0]

    step(4)
    ids, pos, slots, lens, rings, index, block0 = step(3)  # bucket 4: row 3 pads
    assert ids[:3].tolist() == [100, 101, 102] and slots[:3].tolist() == [1, 5, 9]
    assert (ids[3], pos[3], slots[3], lens[3], rings[3], index[3], block0[3]) == (0, 0, 36, 1, 7, 0, 9)


def test_steps_that_replay(tiny_models, replay_capturer):
    g = _engine(str(tiny_models["llama"]), _mixed(), None).engine.runner.graphs
    pos = torch.zeros(3, dtype=torch.int64)
    decode = StepContext(positions=pos, full_slots=pos, num_decode=3,
                         decode=PagedDecode(torch.zeros(3, 5, dtype=torch.int32)))
    assert g.applies(decode) and g.bucket(3) == 4
    chunk = PrefillChunk(3, 0, 4, 0)
    assert not g.applies(StepContext(positions=pos, full_slots=pos, num_decode=3, prefills=[chunk],
                                     decode=decode.decode))
    assert not g.applies(StepContext(positions=pos, full_slots=pos, num_decode=6,
                                     decode=PagedDecode(torch.zeros(6, 5, dtype=torch.int32))))
    wide = g.tables.shape[1] + 1  # wider than any sequence of max_model_len
    assert not g.applies(StepContext(positions=pos, full_slots=pos, num_decode=1,
                                     decode=PagedDecode(torch.zeros(1, wide, dtype=torch.int32))))


def test_policy(tiny_models, replay_capturer):
    path = str(tiny_models["llama"])
    assert _engine(path, "full", True).engine.runner.graphs is None  # --enforce-eager
    # The PyTorch backend decides per step in Python: never captured.
    llm = LLM(path, head_layout="full", kv_cache_memory=1 << 22, dtype="float32", device=DEVICE,
              attention_backend="torch", enforce_eager=None)
    assert llm.engine.runner.graphs is None
    assert llm.engine.runner.kv.num_blocks == llm.engine.cache.num_blocks  # no spare block


def test_capture_failure_falls_back_to_eager(tiny_models, monkeypatch, caplog):
    def broken(device):
        def capture(fn):
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
        return capture

    monkeypatch.setattr(cuda_graphs, "capturer_for", broken)
    path = str(tiny_models["llama"])
    with caplog.at_level(logging.WARNING, logger="headwise.cuda_graphs"):
        llm = _engine(path, _mixed(), None)
    lines = [r for r in caplog.records if r.name == "headwise.cuda_graphs"]
    assert len(lines) == 1 and "decode runs eagerly" in lines[0].getMessage()
    assert "more detail" not in lines[0].getMessage()
    assert not llm.engine.runner.graphs.enabled
    want = _run(_engine(path, _mixed(), True))
    assert [o.token_ids for o in _run(llm)] == [o.token_ids for o in want]


def test_host_reads_fail_a_replay():
    """The stand-in rejects what a graph cannot do (so the equality tests mean something)."""
    cap = ReplayCapturer()
    x = torch.ones(2)
    with step_context(StepContext(positions=x, full_slots=x)):
        replay, _ = cap(lambda: x * int(x.sum().item()))
    with pytest.raises(HostRead):
        replay()
