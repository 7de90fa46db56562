"""A real server on loopback, driven by the official openai client and raw HTTP."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import httpx
import pytest

from headwise import LLM, SamplingParams
from headwise.config import EngineConfig
from headwise.engine.llm_engine import LLMEngine

PROMPTS = ["Once upon a time", "The river runs through the old town and", "Bridges " * 30,
           "Q: what is 2 + 2?\nA:", "word " * 120]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model: str, max_queue: int = 64, api_key: str | None = None,
                   max_request_bytes: int = 4 << 20, **engine_options):
    import uvicorn

    from headwise.server.app import create_app

    opts = dict(head_layout="full", kv_cache_memory=1 << 24, max_model_len=512)
    opts.update(engine_options)
    engine = LLMEngine(EngineConfig.from_options(model, opts))
    app = create_app(engine, max_queue=max_queue, api_key=api_key, max_request_bytes=max_request_bytes)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    try:
        yield url, app
    finally:
        server.should_exit = True
        t.join(timeout=30)
        app.state.engine.shutdown()


@pytest.fixture(scope="module")
def model_path(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def server(model_path):
    with running_server(model_path) as s:
        yield s


@pytest.fixture(scope="module")
def offline(model_path):
    return LLM(model_path, head_layout="full", kv_cache_memory=1 << 24, max_model_len=512)


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _metric(url: str, name: str, missing: float | None = None, **labels) -> float:
    """The metric's value (summed over its series); `missing` where it has none yet (a
    counter no request has touched), else a missing metric fails the test."""
    text = httpx.get(f"{url}/metrics").text
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            rest = line[len(name):]
            if rest[:1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
    if not found and missing is not None:
        return missing
    assert found, f"metric {name} {labels} missing"
    return total


def _wait_idle(url: str, timeout: float = 20) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (_metric(url, "headwise:kv_cache_used_bytes") == 0
                and _metric(url, "headwise:num_requests_running") == 0):
            return
        time.sleep(0.05)
    raise AssertionError("KV cache not freed")


def test_completions_match_offline(server, offline):
    url, _ = server
    c = _client(url)
    model = c.models.list().data[0].id
    for p in PROMPTS[:3]:
        ref = offline.generate(p, SamplingParams(max_tokens=12), use_tqdm=False)[0]
        r = c.completions.create(model=model, prompt=p, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        stream = c.completions.create(model=model, prompt=p, max_tokens=12, temperature=0, stream=True)
        chunks = list(stream)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
        assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_chat_matches_offline(server, offline):
    url, _ = server
    c = _client(url)
    msgs = [{"role": "user", "content": "Tell me about rivers."}]
    ref = offline.chat(msgs, SamplingParams(max_tokens=10), use_tqdm=False)[0]
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=msgs, max_tokens=10,
                                  temperature=0, logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert len(r.choices[0].logprobs.content) == len(ref.token_ids)
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    s = c.chat.completions.create(model=r.model, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(s)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_32_concurrent_streams(server, offline):
    from openai import AsyncOpenAI

    url, _ = server
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(32)]
    lengths = [4 + (i % 5) * 4 for i in range(32)]
    refs = [offline.generate(p, SamplingParams(max_tokens=n), use_tqdm=False)[0].text
            for p, n in zip(prompts, lengths)]

    async def main():
        c = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        model = (await c.models.list()).data[0].id

        async def one(p, n):
            s = await c.completions.create(model=model, prompt=p, max_tokens=n, temperature=0, stream=True)
            return "".join([ch.choices[0].text async for ch in s if ch.choices])

        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    before = _metric(url, "headwise:request_success_total", missing=0.0)  # none yet when run alone
    outs = asyncio.run(main())
    assert outs == refs
    _wait_idle(url)
    assert _metric(url, "headwise:request_success_total") - before == 32


@pytest.mark.parametrize("body, status, param, code", [
    (b"{not json", 400, None, "malformed_json"),
    (b"[1, 2]", 400, None, "invalid_body"),
    (b'{"prompt": "hi", "temperature": -1}', 400, "temperature", "invalid_parameter"),
    (b'{"prompt": "hi", "top_p": 0}', 400, "top_p", "invalid_parameter"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens", "invalid_parameter"),
    (b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens", "invalid_parameter"),
    (b'{"prompt": "hi", "n": 3, "best_of": 2}', 400, "best_of", "invalid_parameter"),
    (b'{"prompt": "hi", "n": 1, "best_of": 2, "stream": true}', 400, "best_of", "invalid_parameter"),
    (b'{"prompt": "hi", "best_of": 2, "temperature": 0}', 400, "best_of", "invalid_parameter"),
    (b'{"prompt": "hi", "model": "gpt-9"}', 400, "model", "model_not_found"),
    (b'{"prompt": 5}', 400, "prompt", "invalid_parameter"),
    (b'{"prompt": "hi", "max_tokens": 600}', 400, "max_tokens", "context_length_exceeded"),
    (b'{"prompt": "hi", "stop": [1]}', 400, "stop", "invalid_parameter"),
])
def test_bad_input_gets_openai_error_envelope(server, body, status, param, code):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code and err["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_context_length_message_names_numbers(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * 100, "max_tokens": 500})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "512" in msg and "500" in msg
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_tokenize_detokenize_models_health(server, offline):
    url, _ = server
    t = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}).json()
    assert t["tokens"] == offline.tokenizer.encode("Hello world") and t["max_model_len"] == 512
    d = httpx.post(f"{url}/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    assert httpx.post(f"{url}/detokenize", json={"tokens": [-1]}).status_code == 400
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "llama"


def _aborted(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return _metric(url, "headwise:request_success_total", finished_reason="abort") if 'reason="abort"' in text else 0.0


def test_disconnect_mid_stream_aborts_and_frees(server):
    url, _ = server
    before = _aborted(url)
    with httpx.stream("POST", f"{url}/v1/completions",
                      json={"prompt": "Bridges", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # got the first token, now hang up
    t0 = time.time()
    while _aborted(url) == before and time.time() - t0 < 20:
        time.sleep(0.05)
    assert _aborted(url) == before + 1
    _wait_idle(url)


def test_full_queue_answers_503(model_path):
    with running_server(model_path, max_queue=1, max_num_seqs=1) as (url, _):
        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                long = c.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 300, "ignore_eos": True})
                task = asyncio.ensure_future(long)
                await asyncio.sleep(0.5)  # the long one is running; one more may wait
                second = asyncio.ensure_future(c.post(f"{url}/v1/completions",
                                                      json={"prompt": "b", "max_tokens": 2}))
                await asyncio.sleep(0.2)
                third = await c.post(f"{url}/v1/completions", json={"prompt": "c", "max_tokens": 2})
                return third, await second, await task

        third, second, first = asyncio.run(main())
        assert third.status_code == 503
        assert third.json()["error"]["code"] == "queue_full"
        assert second.status_code == 200 and first.status_code == 200


def test_forced_preemption_keeps_greedy_output(model_path, offline):
    # 4 blocks of 16 tokens each hold two of these requests at most: preemption is forced.
    block = 2 * 2 * 2 * 16 * 16 * 4  # K+V, 2 layers x 2 kv heads, 16 tokens, D=16, fp32
    with running_server(model_path, kv_cache_memory=6 * block, max_num_seqs=8) as (url, _):
        prompts = ["Bridges " * 6 + str(i) for i in range(4)]
        refs = [offline.generate(p, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)[0].text
                for p in prompts]

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                rs = await asyncio.gather(*(c.post(f"{url}/v1/completions", json={
                    "prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True}) for p in prompts))
                return [r.json()["choices"][0]["text"] for r in rs]

        assert asyncio.run(main()) == refs
        assert _metric(url, "headwise:num_preemptions_total") > 0
        _wait_idle(url)


def test_metrics_series_present_and_moving(server):
    url, _ = server
    names = ["headwise:num_requests_running", "headwise:num_requests_waiting", "headwise:kv_cache_usage_perc",
             "headwise:time_to_first_token_seconds_bucket", "headwise:inter_token_latency_seconds_bucket",
             "headwise:e2e_request_latency_seconds_bucket", "headwise:num_preemptions_total",
             "headwise:prompt_tokens_total", "headwise:generation_tokens_total"]
    before = {n: _metric(url, n) for n in ("headwise:prompt_tokens_total", "headwise:generation_tokens_total",
                                           "headwise:time_to_first_token_seconds_count")}
    httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True})
    text = httpx.get(f"{url}/metrics").text
    for n in names:
        assert n in text, n
    assert 'pool="paged"' in text and 'pool="ring"' in text
    assert _metric(url, "headwise:generation_tokens_total") == before["headwise:generation_tokens_total"] + 5
    assert _metric(url, "headwise:prompt_tokens_total") > before["headwise:prompt_tokens_total"]
    assert _metric(url, "headwise:time_to_first_token_seconds_count") == before[
        "headwise:time_to_first_token_seconds_count"] + 1


def test_bench_serve_reports_every_figure(server):
    from headwise.bench_serve import format_result, run_bench

    url, _ = server
    r = asyncio.run(run_bench(url, num_requests=4, concurrency=2, prompt_tokens=40, max_tokens=6))
    assert r["completed"] == 4 and r["failed"] == 0
    for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(r[k]) == {"mean", "median", "p99"} and r[k]["median"] > 0
    assert r["output_tokens_per_s"] > 0 and r["request_throughput"] > 0
    assert "ttft" in format_result(r)


def test_prefix_cache_usage_metrics_and_reset(model_path, offline):
    """A repeated long prompt is served from the prefix cache: `cached_tokens` in the
    OpenAI usage, the same text, counters and reclaimable bytes per head class in the
    metrics; POST /reset_prefix_cache forgets it."""
    from headwise import HeadLayout
    from headwise.heads.layout import HeadSpec

    shape = offline.layout.shape
    L, H, D = shape
    layout = HeadLayout("mixed", L, H, D, [[HeadSpec("window", 4, 16) if (l + h) % 2 else HeadSpec("full")
                                            for h in range(H)] for l in range(L)])
    with running_server(model_path, head_layout=layout, block_size=4) as (url, _):
        c = _client(url)
        model = c.models.list().data[0].id
        doc = "A long report about rivers, bridges and the towns between them. " * 12
        first = c.completions.create(model=model, prompt=doc, max_tokens=8, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        q0, h0 = _metric(url, "headwise:prefix_cache_queries_total"), _metric(url, "headwise:prefix_cache_hits_total")
        again = c.completions.create(model=model, prompt=doc, max_tokens=8, temperature=0)
        n = again.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 4 * 4
        assert again.choices[0].text == first.choices[0].text
        assert _metric(url, "headwise:prefix_cache_queries_total") == q0 + n
        assert _metric(url, "headwise:prefix_cache_hits_total") == h0 + (n - 1) // 4 * 4
        _wait_idle(url)
        assert _metric(url, "headwise:kv_cache_cached_bytes", pool="paged") > 0
        assert _metric(url, "headwise:kv_cache_cached_bytes", pool="ring") > 0
        msgs = [{"role": "user", "content": doc}]
        a = c.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0)
        s = list(c.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
        assert s[-1].usage.prompt_tokens_details.cached_tokens > 0
        assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == a.choices[0].message.content
        r = httpx.post(f"{url}/reset_prefix_cache")
        assert r.status_code == 200 and r.json()["pages_freed"] > 0
        assert _metric(url, "headwise:kv_cache_cached_bytes") == 0
        after = c.completions.create(model=model, prompt=doc, max_tokens=8, temperature=0)
        assert after.usage.prompt_tokens_details.cached_tokens == 0
        assert after.choices[0].text == first.choices[0].text
