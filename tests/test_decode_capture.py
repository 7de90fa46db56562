"""The captured decode step (engine.decode_capture): torch.compile'd small steps give the
tokens eager steps give, the policy picks where it runs, and a compiler failure falls back
to eager."""
from __future__ import annotations

import logging

import pytest

from headwise import LLM, SamplingParams
from headwise.heads.layout import HeadLayout, HeadSpec
from headwise.config import ConfigError, EngineConfig
from headwise.engine import decode_capture
from tests.conftest import make_tiny_model
from tests.test_gemma3 import TINY as GEMMA
from tests.test_linear import _q4_1_weight

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Once upon a time", "a b c d e f g h i j " * 4]


def _mixed() -> HeadLayout:
    """Layer 0: one full head, one window head (sink 2, window 8); layer 1: full."""
    spec = [[HeadSpec("full"), HeadSpec("window", 2, 8)], [HeadSpec("full"), HeadSpec("full")]]
    return HeadLayout("mixed", 2, 2, 16, spec)


class GraphCalls:
    """Counts the steps that ran the captured graph, by size."""

    def __init__(self, llm) -> None:
        cap = llm.engine.runner.forward
        self.sizes: list[int] = []
        graph = cap.graph

        def counted(model, ids, tables):
            self.sizes.append(ids.shape[0])
            return graph(model, ids, tables)

        cap.graph = counted


def _run(llm, prompts, n=12):
    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=0)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("layout,kv", [("full", "auto"), ("mixed", "auto"), ("mixed", "int8")])
def test_captured_equals_eager_float32(tiny_models, layout, kv):
    """Plain caches (K and V written in one op per class) and int8 ones (values and
    scales written apart) alike."""
    path = str(tiny_models["llama"])
    lay = "full" if layout == "full" else _mixed()
    opts = dict(head_layout=lay, kv_cache_memory=1 << 24, dtype="float32", block_size=4, kv_cache_dtype=kv)
    eager = LLM(path, enforce_eager=True, **opts)
    cap = LLM(path, enforce_eager=False, **opts)
    runner = cap.engine.runner
    assert runner.forward.enabled and runner.forward.compile_s > 0
    assert not eager.engine.runner.forward.enabled
    calls = GraphCalls(cap)
    want = [_run(eager, [p])[0] for p in PROMPTS] + _run(eager, PROMPTS)
    got = [_run(cap, [p])[0] for p in PROMPTS] + _run(cap, PROMPTS)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # Decode at batch 1 and 3, and the 4-token prompt's prefill, ran captured; longer
    # prefills ran eagerly.
    assert {1, 3} <= set(calls.sizes) and max(calls.sizes) <= decode_capture.CAPTURE_MAX_TOKENS
    assert 4 in calls.sizes


def test_engines_alike_in_shape_keep_their_own_graphs(tmp_path, tokenizer_dir):
    """Two models of one shape (other weights, other rotary base) captured in one process:
    each runs its own weights, not a cached graph of the other."""
    opts = dict(head_layout="full", kv_cache_memory=1 << 22, dtype="float32")
    paths = [str(make_tiny_model("llama", tmp_path / str(i), tokenizer_dir, seed=i, rope_theta=1e4 * (i + 1)))
             for i in range(2)]
    captured = [LLM(p, enforce_eager=False, **opts) for p in paths]
    for p, llm in zip(paths, captured):
        want = _run(LLM(p, enforce_eager=True, **opts), PROMPTS)
        assert [o.token_ids for o in _run(llm, PROMPTS)] == [o.token_ids for o in want]
    assert _run(captured[0], PROMPTS)[0].token_ids != _run(captured[1], PROMPTS)[0].token_ids


def test_captured_gemma3_equals_eager(tmp_path, tokenizer_dir):
    """QK-norm, sandwich norms, scaled embeddings and the native sliding-window layers."""
    path = str(make_tiny_model("gemma3", tmp_path / "g", tokenizer_dir, **GEMMA))
    opts = dict(kv_cache_memory=1 << 24, dtype="float32")
    want = _run(LLM(path, enforce_eager=True, **opts), PROMPTS, n=16)
    got = _run(LLM(path, enforce_eager=False, **opts), PROMPTS, n=16)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def _int4_model(tmp_path, tokenizer_dir):
    """A tiny Llama whose projections are exactly 4-bit (GGUF Q4_1's grid), as the
    default model's are: bfloat16 decode then reads their 4-bit copies."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model("llama", tmp_path / "q4", tokenizer_dir)
    f = path / "model.safetensors"
    sd = load_file(str(f))
    for i, name in enumerate(n for n in sd if n.endswith("proj.weight")):
        sd[name] = _q4_1_weight(*sd[name].shape, seed=i)[0].contiguous()
    save_file(sd, str(f), metadata={"format": "pt"})
    return str(path)


def test_policy_captures_4bit_cpu_decode_by_default(tmp_path, tokenizer_dir, tiny_models, caplog):
    opts = dict(head_layout="full", kv_cache_memory=1 << 22)
    # Float32 weights: no 4-bit decode, nothing measured to pay, eager unless asked.
    assert not LLM(str(tiny_models["llama"]), dtype="float32", **opts).engine.runner.forward.enabled
    path = _int4_model(tmp_path, tokenizer_dir)
    with caplog.at_level(logging.INFO, logger="headwise.capture"):
        llm = LLM(path, dtype="bfloat16", **opts)
    said = [r.getMessage() for r in caplog.records if r.name == "headwise.capture"]
    assert said[0].startswith("compiling the decode step") and said[1].startswith("decode step captured")
    cap = llm.engine.runner.forward
    assert decode_capture.reads_int4(llm.engine.model) and cap.enabled and cap.compile_s > 0
    calls = GraphCalls(llm)
    out = _run(llm, [PROMPTS[0]], n=6)[0]
    assert len(out.token_ids) == 6 and calls.sizes == [1] * 5
    eager = LLM(path, dtype="bfloat16", enforce_eager=True, **opts)
    assert not eager.engine.runner.forward.enabled
    # bfloat16 through another int4 kernel (Inductor's): the first token comes from the
    # eager prefill in both, and the next step's logits agree to bfloat16 precision.
    ref = _run(eager, [PROMPTS[0]], n=6)[0]
    assert out.token_ids[0] == ref.token_ids[0]
    assert abs(out.logprobs[1] - ref.logprobs[1]) < 0.05 or out.token_ids[1] != ref.token_ids[1]


@pytest.mark.parametrize("amx", [True, False])
def test_captured_steps_pick_the_4bit_kernel_by_rows(tmp_path, tokenizer_dir, monkeypatch, amx):
    """The graph of 2-8 tokens leaves its row count open, so its 4-bit matmuls are an op
    that picks the kernel per call: with AMX, steps of 5-8 rows multiply through
    codes_gemm.int4_gemm (faster there than PyTorch's int4 kernel), steps of at most 4
    through PyTorch's; without AMX every captured step keeps PyTorch's. Tokens as an
    eager engine's."""
    from headwise.kernels import codes_gemm
    from headwise.layers import int4

    if not codes_gemm.available() or (amx and not codes_gemm.gemm_amx()):
        pytest.skip("no codes_gemm kernel" + (" with AMX" if amx else "") + " on this machine")
    was = codes_gemm.gemm_amx()
    codes_gemm.gemm_amx(amx)
    try:
        path = _int4_model(tmp_path, tokenizer_dir)
        opts = dict(head_layout="full", kv_cache_memory=1 << 22, dtype="bfloat16")
        eager = LLM(path, enforce_eager=True, **opts)
        llm = LLM(path, **opts)
        assert llm.engine.runner.forward.enabled
        # int4_gemm is read when the op runs, never while Dynamo traces (so patching it
        # recompiles nothing); the prefill's calls (more than 8 rows) are counted too.
        rows, gemm = [], int4.int4_gemm

        def counted_gemm(x, codes, sz):
            y = gemm(x, codes, sz)
            if y is not None:
                rows.append(x.shape[0])
            return y

        monkeypatch.setattr(int4, "int4_gemm", counted_gemm)
        calls = GraphCalls(llm)
        for n in (6, 3):
            prompts = [f"{i} " + PROMPTS[i % 3] for i in range(n)]
            want = _run(eager, prompts, n=6)
            rows.clear()
            calls.sizes.clear()
            got = _run(llm, prompts, n=6)
            assert calls.sizes == [n] * 5  # every step after the prefill ran the graph
            assert (n in rows) == (amx and n > int4.INT4_MAX_ROWS_AMX)
            for a, b in zip(want, got):
                assert a.token_ids[:2] == b.token_ids[:2]
    finally:
        codes_gemm.gemm_amx(was)


def test_compile_failure_falls_back_to_eager(tiny_models, monkeypatch, caplog):
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler here\nmore detail")
        return run

    monkeypatch.setattr(decode_capture.torch, "compile", broken)
    path = str(tiny_models["llama"])
    opts = dict(head_layout="full", kv_cache_memory=1 << 22, dtype="float32")
    with caplog.at_level(logging.WARNING, logger="headwise.capture"):
        llm = LLM(path, enforce_eager=False, **opts)
    warnings = [r for r in caplog.records if r.name == "headwise.capture"]
    assert len(warnings) == 1 and "running eagerly: RuntimeError: no C++ compiler here" in warnings[0].getMessage()
    assert not llm.engine.runner.forward.enabled
    monkeypatch.undo()
    want = _run(LLM(path, enforce_eager=True, **opts), PROMPTS)
    assert [o.token_ids for o in _run(llm, PROMPTS)] == [o.token_ids for o in want]


def test_enforce_eager_option():
    assert EngineConfig().enforce_eager is None
    with pytest.raises(ConfigError, match="enforce_eager must be True, False or None"):
        EngineConfig(enforce_eager="yes")
    from headwise.cli import build_parser

    p = build_parser()
    assert p.parse_args(["generate", "--prompt", "x", "--enforce-eager"]).enforce_eager is True
    assert p.parse_args(["serve", "--no-enforce-eager"]).enforce_eager is False
    assert p.parse_args(["serve"]).enforce_eager is None
