"""Qwen2.5-Coder-0.5B-Instruct (GQA, 14 query / 2 KV heads, 24 blocks) by its known name,
assembled from its chunk packages: its chat template and stop token come from the GGUF as
transformers reads them, greedy output equals transformers' on the same file, and a
prefix-cache hit computes the same tokens as a cold run; with its gate-calibrated layout,
prefix hits, the disk tier, the server and int8 KV work. Prompts of at most ~1K tokens
(load and prefill time)."""
import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from headwise import LLM, SamplingParams
from headwise.evaluation.sources import LICENSE_DIR
from headwise.server.app import create_app

NAME = "qwen2.5-coder-0.5b"
LAYOUT = Path(__file__).resolve().parents[1] / "headwise/layouts/qwen2.5-coder-0.5b-instruct-gates-50-w512.json"
LICENSE = LICENSE_DIR / "Apache-2.0"
CHAT = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]


@pytest.fixture(scope="module")
def qwen():
    from headwise.weights.registry import parted_model_path

    try:
        path = parted_model_path(NAME)
    except FileNotFoundError as e:  # `make install` installs its packages
        pytest.fail(f"{NAME} is not installed: {e}")
    return path, LLM(NAME, head_layout="full", dtype="float32", enforce_eager=True, max_model_len=2048,
                     kv_cache_memory=1 << 28)


def test_known_name_chat_template_and_stop_token(qwen):
    _, llm = qwen
    assert llm.engine.model_name == "Qwen2.5-Coder-0.5B-Instruct"
    cfg = llm.engine.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (24, 14, 2)
    text = llm.tokenizer.apply_chat_template(CHAT)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert llm.tokenizer.decode([min(llm.engine.eos_ids)], skip_special_tokens=False) == "<|im_end|>"
    out = llm.chat([{"role": "user", "content": "What is 2 + 3? Reply with the number only."}],
                   SamplingParams(max_tokens=16))[0]
    assert out.finish_reason == "stop" and out.text.strip() == "5", out.text


def test_greedy_matches_transformers_and_prefix_hits_change_nothing(qwen):
    from transformers import AutoModelForCausalLM

    path, llm = qwen
    ids = llm.tokenizer.encode_chat(CHAT)
    cold = llm.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    warm = llm.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert warm.num_cached_tokens > 0 and warm.token_ids == cold.token_ids
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    assert cold.token_ids == ref


def test_split_layout_prefix_hits_disk_tier_server_and_int8(qwen, tmp_path):
    """The shipped-candidate layout (gates 50%, window 512): a prefix hit past the window
    (ring snapshots restored), the same prefix read back from the disk tier by a new
    engine, and the server's completion all equal the first, cold run; int8 KV answers."""
    doc = LICENSE.read_text()[:3200]  # ~650 tokens: past sink + window
    opts = dict(head_layout=str(LAYOUT), dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=2,
                kv_cache_memory=1 << 27)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = doc + "\n\nWhich license is this?"
    llm = LLM(NAME, kv_offload_dir=str(tmp_path), **opts)
    assert llm.layout.class_counts()["window"] > 0
    cold = llm.generate([first], params)[0]  # nothing cached yet
    hit = llm.generate([first], params)[0]
    assert hit.num_cached_tokens > 64 + 512 and hit.token_ids == cold.token_ids
    llm.engine.cache.tier.flush()
    llm.close()
    again = LLM(NAME, kv_offload_dir=str(tmp_path), **opts)  # memory empty: the prefix comes from disk
    from_disk = again.generate([first], params)[0]
    assert from_disk.num_cached_tokens > 64 + 512 and from_disk.token_ids == cold.token_ids
    assert again.engine.cache.tier.stats.hit_tokens > 0
    r = TestClient(create_app(again.engine)).post(
        "/v1/completions", json={"prompt": first, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == cold.text, r.text
    q = LLM(NAME, kv_cache_dtype="int8", **opts)
    assert q.kv_bytes(2048) < 0.3 * again.kv_bytes(2048)
    out = q.chat([{"role": "user", "content": "What is 2 + 3? Reply with the number only."}],
                 SamplingParams(max_tokens=16))[0]
    assert out.text.strip() == "5", out.text


def test_tokenizer_by_type_is_the_one_autotokenizer_builds(qwen):
    """weights.loader.TOKENIZER_TYPES: naming the tokenizer type skips AutoTokenizer's
    config pass over the file; the tokenizer is the same as without it."""
    from transformers import AutoTokenizer

    from headwise.tokenizer import Tokenizer, _same_tokenizer
    from headwise.weights.loader import TOKENIZER_TYPES

    path, _ = qwen
    fast = Tokenizer.from_path(path.parent, path.name, tokenizer_type=TOKENIZER_TYPES["qwen2"]).hf
    auto = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(fast) is type(auto) and _same_tokenizer(auto, fast)


def test_tool_calls_and_fill_in_the_middle(qwen):
    """auto: Qwen's template shows the tools and the reply becomes a call (plain and
    streamed); an earlier call and its result are written into the prompt in its format;
    a completion with a suffix fills in the middle. Last in this file: the app's engine
    thread owns the engine from here on."""
    _, llm = qwen
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string"}}, "required": ["city"]}}}
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    history = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C and sunny"}]
    from headwise.server.inputs import chat_messages
    from headwise.server.protocol import ChatMessage
    from headwise.tokenizer import ChatOptions

    text = llm.tokenizer.apply_chat_template(chat_messages([ChatMessage(**m) for m in history]),
                                             ChatOptions(tools=[weather]))
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in text
    with TestClient(create_app(llm.engine)) as c:
        body = {"messages": ask, "tools": [weather], "max_tokens": 40, "temperature": 0}
        r = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert r["finish_reason"] == "tool_calls", r
        call = r["message"]["tool_calls"][0]["function"]
        assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
        lines = c.post("/v1/chat/completions", json=body | {"stream": True}).text.splitlines()
        deltas = [json.loads(x[6:])["choices"][0] for x in lines if x.startswith("data: {")]
        streamed = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
        assert [t["function"]["arguments"] for t in streamed] == [call["arguments"]]
        assert deltas[-1]["finish_reason"] == "tool_calls"
        r = c.post("/v1/chat/completions", json={"messages": history, "tools": [weather], "max_tokens": 40,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        # fill in the middle (completions' suffix), in Qwen2.5-Coder's own <|fim_*|> form
        r = c.post("/v1/completions", json={"prompt": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))\n",
                                            "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"].replace(" ", "").startswith("a+b"), r.text


def test_int8_weights_kept_as_codes_only_answer_as_their_dense_copies(qwen, monkeypatch):
    """dense_weights=False keeps the 0.5B's int8-coded weights (Q5_0, Q8_0, Q6_K) with no
    dense copy: prefill and batched calls multiply its codes (kernels.codes_gemm.int8_gemm,
    whose tile is the dense bfloat16 weight exactly), so greedy tokens are those of an
    engine whose int8 weights keep prepacked dense copies, the 4-bit ones alike in both,
    and their log-probabilities differ by summation order only. The MLP's gated product
    over two int8 weights (one kernel call, rounded once) is turned off for this: it
    rounds otherwise than two matmuls (tests/test_linear.py). (The chat without its last
    newline is a near tie between two first tokens, which summation order alone flips:
    not asked.)"""
    import headwise.models.llama as llama
    from headwise.kernels.codes_gemm import int8_gemm
    from headwise.layers.int4 import INT4_DTYPES
    from headwise.layers.linear import Linear

    if int8_gemm(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.int8),
                 torch.ones(64, 1)) is None:
        pytest.skip("no AVX512-BF16 matmul over int8 codes on this machine")
    monkeypatch.setattr(llama, "int8_glu", lambda *a: None)
    opts = dict(head_layout="full", dtype="bfloat16", dense_weights=False, prepared_weights_cache=False,
                enforce_eager=True, max_model_len=2048, kv_cache_memory=1 << 27)
    ids = qwen[1].tokenizer.encode_chat(CHAT)
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0)
    codes = LLM(NAME, **opts)
    int8_only = [m for m in codes.engine.model.modules() if isinstance(m, Linear) and m.codes_only and m.int4 is None]
    # 157 of its 169 linears are Q5_0, Q8_0 or Q6_K
    assert len(int8_only) > 150 and all(m.packed is None and m.int8_codes is not None for m in int8_only)
    got = codes.generate([ids], params)
    del codes
    monkeypatch.setattr(Linear, "codes_suffice", lambda self, dtype: self.int4 is not None and dtype in INT4_DTYPES)
    dense = LLM(NAME, **opts)
    assert not any(m.codes_only and m.int4 is None for m in dense.engine.model.modules() if isinstance(m, Linear))
    want = dense.generate([ids], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # bfloat16 activations summed in another order through 24 layers: 0.06 measured
    assert max(abs(a - b) for a, b in zip(got[0].logprobs, want[0].logprobs)) < 0.2
