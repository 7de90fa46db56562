"""Scale-out on Ray Serve: two engine replicas of a tiny model behind one OpenAI endpoint.

One local Ray cluster (2 CPUs, no dashboard, loopback) for the module; the last test shuts
it down and checks that no Ray process is left, then runs `headwise serve --replicas 1`.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from headwise import LLM, SamplingParams
from headwise.server.routing import PrefixAffinity, block_hashes
from tests.test_server import PROMPTS, _free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
R = pytest.importorskip("headwise.server.ray_serve")

OPTS = dict(head_layout="full", kv_cache_memory=1 << 24, max_model_len=512)


# ---- routing bookkeeping, without Ray ---------------------------------------------------

def test_affinity_prefers_the_holder_then_balances():
    a = PrefixAffinity(imbalance=2, min_match=0.5)
    doc1, doc2 = list(range(100, 260)), list(range(300, 460))
    h1, h2 = block_hashes(doc1 + [7, 8, 9] * 6), block_hashes(doc2 + [1] * 20)
    assert a.rank(h1, ["b", "a"]) == [["a"], ["b"]]  # nothing known: least loaded, then by name
    a.routed("r1", "a", h1)
    a.completed("r1")
    # A new document goes to the replica holding fewer blocks (spreads memory).
    assert a.rank(h2, ["a", "b"])[0] == ["b"]
    a.routed("r2", "b", h2)
    a.completed("r2")
    # Follow-ups (same document, another question) go to the document's replica...
    follow = block_hashes(doc1 + [5] * 30)
    assert a.holders(follow, ["a", "b"]) == ({"a"}, len(doc1) // 16)
    assert a.rank(follow, ["a", "b"])[0] == ["a"]
    # ...until it is busier than the least loaded by more than `imbalance`.
    for i in range(3):
        a.routed(f"busy{i}", "a", [])
    assert a.rank(follow, ["a", "b"])[0] == ["b"]
    for i in range(3):
        a.completed(f"busy{i}")
    assert a.rank(follow, ["a", "b"])[0] == ["a"]
    # A replica that is not a candidate (full, dead) is never ranked.
    assert a.rank(follow, ["b"]) == [["b"]]
    a.forget("a")
    assert a.holders(follow, ["a", "b"]) == (set(), 0)
    assert a.rank([], []) == []


def test_requests_routed_at_once_see_each_other(monkeypatch):
    a = PrefixAffinity()
    # Chosen, not yet confirmed: the next request must not pick the same idle replica.
    a.reserve("r1", a.rank([], ["a", "b"])[0][0])
    a.reserve("r2", a.rank([], ["a", "b"])[0][0])
    assert {a.load("a"), a.load("b")} == {1}
    a.routed("r1", "b", [])  # Serve sent it elsewhere than reserved: the load follows
    assert a.load("b") == 2 - (a._reserved["r2"][0] != "b")
    a.routed("r1", "a", [])  # a retry on another replica moves it
    a.completed("r1")
    a.completed("r2")
    assert a.load("a") == a.load("b") == 0
    # A reservation never confirmed (cancelled while routing) stops counting.
    a.reserve("r3", "a")
    t = time.monotonic()
    monkeypatch.setattr("headwise.server.routing.time.monotonic", lambda: t + 11)
    assert a.load("a") == 0 and not a._reserved


def test_affinity_ignores_a_short_shared_prefix_and_bounds_memory():
    a = PrefixAffinity(imbalance=4, min_match=0.5, max_blocks=40)
    system = list(range(1000, 1032))  # two blocks every chat shares
    a.routed("r1", "a", block_hashes(system + list(range(2000, 2320))))
    # A new document behind the same system prompt: 2 of 22 blocks match, below min_match.
    new = block_hashes(system + list(range(5000, 5320)))
    assert a.holders(new, ["a", "b"])[1] == 2
    assert a.rank(new, ["a", "b"])[0] == ["b"]
    a.routed("r2", "b", new)
    assert len(a._owners) <= 40 and sum(a._blocks.values()) == sum(len(o) for o in a._owners.values())
    with pytest.raises(ValueError, match="min_match"):
        PrefixAffinity(min_match=2)
    assert block_hashes(list(range(40))) == block_hashes(list(range(32)))  # whole blocks only
    assert block_hashes([1] * 15) == []


def test_metrics_of_replicas_merge_into_one_exposition():
    text = ("# HELP headwise:prompt_tokens_total Prefilled\n# TYPE headwise:prompt_tokens_total counter\n"
            'headwise:prompt_tokens_total{model_name="m"} {v}\n')
    merged = R.merge_metrics([("r1", text.replace("{v}", "3.0")), ("r2", text.replace("{v}", "5.0"))])
    assert merged.count("# TYPE headwise:prompt_tokens_total counter") == 1
    assert 'headwise:prompt_tokens_total{model_name="m",replica="r1"} 3.0' in merged
    assert 'headwise:prompt_tokens_total{model_name="m",replica="r2"} 5.0' in merged


def test_build_app_refuses_bad_options(tiny_models):
    with pytest.raises(ValueError, match="replicas"):
        R.build_app(str(tiny_models["llama"]), OPTS, replicas=0)
    with pytest.raises(ValueError, match="routing"):
        R.build_app(str(tiny_models["llama"]), OPTS, routing="random")
    with pytest.raises(ValueError, match="app_builder needs model"):
        R.app_builder({"replicas": "2"})


def test_the_documented_serve_config_builds_the_app():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    with open(Path(__file__).parent.parent / "docs" / "ray_serve.yaml", encoding="utf-8") as f:
        config = ServeDeploySchema.model_validate(yaml.safe_load(f))
    (app,) = config.applications
    assert app.import_path == "headwise.server.ray_serve:app_builder"
    assert isinstance(R.app_builder(app.args), serve.Application)
    assert config.http_options.host == "127.0.0.1"


class _FakeBroadcast:
    def __init__(self, results):
        self.results = results

    async def results_async(self, timeout_s=None, return_exceptions=False):
        return self.results


class _FakeResponse:
    """A streaming DeploymentResponse: yields `items`, raising the exceptions among them."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class _FakeHandle:
    def __init__(self, results=None, responses=()):
        self._results, self.responses, self.sent = results or {}, list(responses), 0
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, req):
        self.sent += 1
        return self.responses.pop(0)

    def broadcast(self, method):
        return _FakeBroadcast(self._results[method])


def test_the_client_resends_what_a_lost_replica_never_admitted():
    import asyncio

    from headwise.engine.scheduler import QueueFullError
    from headwise.server.engine_client import Update

    lost = ray.exceptions.ActorDiedError()
    done = Update("hi", [5], [], [], True, "length", num_prompt_tokens=3, num_output_tokens=1)

    async def run(responses):
        client = R.RayEngineClient(_FakeHandle(responses=responses), None, 2)
        stream = await client.submit([1, 2, 3], SamplingParams(max_tokens=1), "r1")
        return client.handle.sent, await stream.queue.get()

    assert asyncio.run(run([_FakeResponse([lost]), _FakeResponse([None, done])])) == (2, done)
    # Lost mid-request (after admission): the request ends with a 503 update, not resent.
    sent, u = asyncio.run(run([_FakeResponse([None, lost])]))
    assert sent == 1 and u.finished and u.error_status == 503 and u.error_code == "replica_unavailable"
    with pytest.raises(R.EngineUnavailableError):
        asyncio.run(run([_FakeResponse([lost]) for _ in range(R.ADMIT_ATTEMPTS)]))
    with pytest.raises(QueueFullError):
        asyncio.run(run([_FakeResponse([ray.serve.exceptions.BackPressureError(num_queued_requests=9,
                                                                                max_queued_requests=8)])]))


def test_health_and_reset_tell_when_replicas_are_missing():
    import asyncio

    lost = ray.exceptions.ActorDiedError()
    client = R.RayEngineClient(_FakeHandle({"health": [True, lost], "reset_prefix_cache": [3, lost]}), None, 3)
    ok, body = asyncio.run(client.health())
    assert ok and body == {"status": "degraded", "replicas": {"healthy": 1, "expected": 3}}
    with pytest.raises(R.EngineUnavailableError, match="1 engine replica"):
        asyncio.run(client.reset_prefix_cache())
    client = R.RayEngineClient(_FakeHandle({"health": [lost]}), None, 2)
    ok, body = asyncio.run(client.health())
    assert not ok and body["status"] == "unavailable"
    assert R._failure(lost).error_code == "replica_unavailable" and R._failure(lost).error_status == 503
    assert R._failure(RuntimeError("bug")).error_status == 500


# ---- a live cluster -----------------------------------------------------------------------

def _ray_processes() -> set[int]:
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"raylet" in cmd or b"gcs_server" in cmd or cmd.startswith(b"ray::"):
            found.add(int(pid))
    return found


@pytest.fixture(scope="module")
def cluster(tiny_models):
    before = _ray_processes()
    R.start_ray(None, num_cpus=2)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=R.QUIET)
    model = str(tiny_models["llama"])
    serve.run(R.build_app(model, OPTS, replicas=2, cpus_per_replica=0.5), name=R.APP_NAME, route_prefix="/")
    serve.run(R.build_app(model, OPTS, replicas=2, cpus_per_replica=0.25, routing="round-robin"),
              name="round-robin", route_prefix="/rr")
    # An engine that admits nothing: its refusal must cross Ray as itself.
    serve.run(R.build_app(model, OPTS, replicas=1, cpus_per_replica=0.25, max_queue=0),
              name="refusing", route_prefix="/full")
    state = {"url": f"http://127.0.0.1:{port}", "model": model, "before": before, "up": True}
    yield state
    if state["up"]:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single(cluster):
    return LLM(cluster["model"], **OPTS)


def test_two_replicas_answer_the_openai_client_like_one_engine(cluster, single):
    from openai import OpenAI

    client = OpenAI(base_url=cluster["url"] + "/v1", api_key="unused", max_retries=0)
    want = [o.text for o in single.generate(PROMPTS, SamplingParams(max_tokens=12), use_tqdm=False)]
    got = [client.completions.create(model="llama", prompt=p, max_tokens=12, temperature=0).choices[0].text
           for p in PROMPTS]
    assert got == want
    streamed = ["".join(c.choices[0].text for c in client.completions.create(
        model="llama", prompt=p, max_tokens=12, temperature=0, stream=True)) for p in PROMPTS]
    assert streamed == want
    chat = client.chat.completions.create(model="llama", max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Say hi"}])
    ref = single.chat([{"role": "user", "content": "Say hi"}], SamplingParams(max_tokens=8), use_tqdm=False)
    assert chat.choices[0].message.content == ref[0].text
    assert [m.id for m in client.models.list().data] == ["llama"]


def test_a_refusing_replica_answers_503_queue_full(cluster):
    r = httpx.post(cluster["url"] + "/full/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    r = httpx.post(cluster["url"] + "/full/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"


def test_errors_keep_the_openai_envelope(cluster):
    r = httpx.post(cluster["url"] + "/v1/completions", json={"prompt": "hi " * 600, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(cluster["url"] + "/v1/completions", json={"prompt": [[1, 99999999]], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def _documents(single) -> list[str]:
    rng = random.Random(0)
    words = single.engine.tokenizer.decode(list(range(1000, 9000)))
    words = words.split()
    return [" ".join(rng.choice(words) for _ in range(220)) for _ in range(4)]


def _hit_rate(url: str, requests: list[tuple[str, str]]) -> tuple[float, list[int]]:
    """Prompt tokens served from a prefix cache over all prompt tokens; cached tokens each."""
    cached, total, each = 0, 0, []
    for doc, q in requests:
        r = httpx.post(url + "/v1/completions", json={"prompt": doc + "\nQuestion: " + q, "max_tokens": 2,
                                                      "temperature": 0}, timeout=60).json()
        cached += r["usage"]["prompt_tokens_details"]["cached_tokens"]
        total += r["usage"]["prompt_tokens"]
        each.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    return cached / total, each


def test_prefix_affinity_keeps_each_document_on_one_replica(cluster, single):
    docs = _documents(single)
    order = [(d, f"what is item {i}?") for i in range(5) for d in docs]
    random.Random(1).shuffle(order)  # so that turns do not line up with round-robin
    single.reset_prefix_cache()
    one = sum(o.num_cached_tokens for o in (single.generate(d + "\nQuestion: " + q, SamplingParams(max_tokens=2),
                                                            use_tqdm=False)[0] for d, q in order))
    one /= sum(len(single.engine.encode(d + "\nQuestion: " + q)) for d, q in order)
    affinity, each = _hit_rate(cluster["url"], order)
    robin, _ = _hit_rate(cluster["url"] + "/rr", order)
    print(f"\nprefix-cache hit rate, 20 requests over 4 documents: one engine {one:.3f}, "
          f"two replicas with prefix affinity {affinity:.3f}, round-robin {robin:.3f}")
    # Every document's follow-ups found the document cached: they reached its replica.
    first = {}
    for (d, _), c in zip(order, each):
        if d in first:
            assert c >= len(single.engine.encode(d)) - 16
        first.setdefault(d, c)
    assert affinity >= one - 1e-9
    assert robin < affinity


def test_health_metrics_and_reset_cover_every_replica(cluster):
    h = httpx.get(cluster["url"] + "/health")
    assert h.status_code == 200 and h.json() == {"status": "ok", "replicas": {"healthy": 2, "expected": 2}}
    text = httpx.get(cluster["url"] + "/metrics").text
    replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("headwise:prompt_tokens_total")}
    assert len(replicas) == 2
    r = httpx.post(cluster["url"] + "/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["pages_freed"] > 0


def _stream(url: str, prompt: str, out: list, started: threading.Semaphore) -> None:
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": 480 - len(prompt.split()) * 2, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 2:
                        started.release()
    except httpx.HTTPError as e:
        events.append({"error": {"code": type(e).__name__}})
    out.append(events)


def test_a_killed_replica_fails_only_its_requests_and_is_replaced(cluster):
    url = cluster["url"]
    engine = serve.get_deployment_handle(R.ENGINE, R.APP_NAME)
    pids = engine.broadcast("pid").results()
    assert len(pids) == 2
    results: list = []
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=_stream, args=(url, f"story number {i} begins", results, started))
               for i in range(4)]
    for t in threads:
        t.start()
    for _ in threads:  # the four are decoding, two on each replica (each ~470 tokens to go)
        assert started.acquire(timeout=60)
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 4
    lost = [ev for ev in results if ev and "error" in ev[-1]]
    done = [ev for ev in results if ev and ev[-1].get("choices") and ev[-1]["choices"][0]["finish_reason"]]
    assert lost and done and len(lost) + len(done) == 4
    for ev in lost:
        assert ev[-1]["error"]["code"] == "replica_unavailable"
        assert ev[-1]["error"]["type"] == "service_unavailable_error"
    # The service keeps answering while Serve replaces the replica...
    for _ in range(5):
        r = httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
    # ...and /health tells until it has.
    deadline = time.time() + 90
    seen = set()
    while time.time() < deadline:
        body = httpx.get(url + "/health", timeout=30).json()
        seen.add(body["replicas"]["healthy"])
        if body["status"] == "ok" and 1 in seen:
            break
        time.sleep(0.5)
    assert body["status"] == "ok" and body["replicas"]["healthy"] == 2
    assert set(engine.broadcast("pid").results()) - {pids[0]}


def _no_new_ray_processes(before: set[int]) -> bool:
    deadline = time.time() + 30
    while _ray_processes() - before and time.time() < deadline:
        time.sleep(0.5)
    return not _ray_processes() - before


def _run_cli(model: str, *extra: str) -> tuple[int, str]:
    """`headwise serve` with `extra` options: answer one request, SIGTERM, (exit code, output)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "headwise.cli", "serve", "--model", model,
                             "--port", str(port), "--head-layout", "full", "--kv-cache-memory", str(1 << 24),
                             "--max-model-len", "512", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hello", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    return proc.returncode, out


def test_shutdown_leaves_no_ray_processes_and_the_cli_deploys(cluster):
    serve.shutdown()
    ray.shutdown()
    cluster["up"] = False
    assert _no_new_ray_processes(cluster["before"])
    # `headwise serve --replicas 1`: its own local Ray, all of it gone after SIGTERM.
    code, out = _run_cli(cluster["model"], "--replicas", "1")
    assert code == 0 and "headwise stopped" in out, out
    assert _no_new_ray_processes(cluster["before"])
    # `headwise serve --replicas 1 --ray-address`: joins a cluster started with `ray start`
    # and, stopped by SIGTERM, removes its application and leaves the cluster up.
    ray_bin = Path(sys.executable).parent / "ray"
    port = _free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    subprocess.run([str(ray_bin), "start", "--head", "--port", str(port), "--num-cpus", "1",
                    "--node-ip-address", "127.0.0.1", "--include-dashboard", "false", "--disable-usage-stats"],
                   check=True, capture_output=True, env=env)
    try:
        code, out = _run_cli(cluster["model"], "--replicas", "1", "--ray-address", f"127.0.0.1:{port}")
        assert code == 0, out
        assert "headwise stopped" in out
        assert _ray_processes() - cluster["before"]  # the cluster is still there
    finally:
        subprocess.run([str(ray_bin), "stop", "--force"], capture_output=True, env=env)
    assert _no_new_ray_processes(cluster["before"])
