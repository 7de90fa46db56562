"""Generation on a tiny model: chunking, batching, sampling, stops, bad input."""
import pytest
import torch

from headwise import LLM, SamplingParams
from headwise.config import ConfigError
from headwise.engine.request_checks import PromptTooLongError
from headwise.engine.scheduler import RequestTooLargeError
from headwise.models.config import UnsupportedModelError
from headwise.sampling import InvalidParameterError
from tests.conftest import assert_batched_equals_single

PROMPTS = ["Once upon a time", "The river runs through the old town and", "Q: 2 + 2?\nA:",
           "Bridges " * 40]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), head_layout="full", kv_cache_memory=1 << 24,
               max_num_batched_tokens=64, max_model_len=512)


def _assert_idle(llm):
    usage = llm.cache_usage()
    assert usage["paged"]["used_bytes"] == 0 and usage["ring"]["used_bytes"] == 0
    assert not llm.engine.has_unfinished()


def test_chunked_prefill_equals_one_pass(llm):
    ids = llm.tokenizer.encode(PROMPTS[3])
    one = llm.engine.prompt_logits(ids, chunk_size=len(ids))
    for chunk in (1, 5, 16, 33):
        assert (llm.engine.prompt_logits(ids, chunk_size=chunk) - one).abs().max().item() < 1e-4


def test_batched_equals_one_by_one(llm):
    assert_batched_equals_single(llm, PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0))
    _assert_idle(llm)


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    a = llm.generate(PROMPTS[:2], p, use_tqdm=False)
    b = llm.generate(PROMPTS[:2], p, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    c = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=16, temperature=1.0, seed=124, ignore_eos=True),
                     use_tqdm=False)
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_top_k_1_is_greedy(llm):
    g = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    k1 = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.8, top_k=1, seed=5,
                                                 ignore_eos=True))[0]
    assert g.token_ids == k1.token_ids


def test_finish_reasons_stop_strings_and_stop_ids(llm):
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    s = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert s.finish_reason == "stop" and s.token_ids == base.token_ids[: first + 1]
    word = base.text[len(base.text) // 2:][:4]
    if word.strip():
        t = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, stop=[word], ignore_eos=True))[0]
        assert t.finish_reason == "stop" and word not in t.text and base.text.startswith(t.text)


def test_logprobs_match_prompt_logits(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))[0]
    ids = out.prompt_token_ids + out.token_ids
    lp = torch.log_softmax(llm.engine.prompt_logits(ids), -1)
    n = len(out.prompt_token_ids)
    for t, tok in enumerate(out.token_ids):
        assert abs(out.logprobs[t] - float(lp[n - 1 + t, tok])) < 1e-4
        assert tok in out.top_logprobs[t] and len(out.top_logprobs[t]) == 3


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=-5), "top_k"),
])
def test_invalid_sampling_values(kwargs, param):
    with pytest.raises(InvalidParameterError, match=param) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_sampling_params_per_prompt(llm):
    """One SamplingParams per prompt, as vLLM takes them: each request runs under its own."""
    a, b = SamplingParams(max_tokens=5, ignore_eos=True), SamplingParams(max_tokens=13, ignore_eos=True)
    out = llm.generate(PROMPTS[:2], [a, b], use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [5, 13]
    assert out[1].token_ids == llm.generate(PROMPTS[1], b)[0].token_ids
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(PROMPTS[:3], [a, b])
    long = list(range(100, 600))  # checked against its own max_tokens: nothing queued
    with pytest.raises(PromptTooLongError, match="500 in the prompt, 13"):
        llm.generate([PROMPTS[0], long], [a, b])
    _assert_idle(llm)


def test_prompt_longer_than_max_model_len(llm):
    long = list(range(100, 600))
    with pytest.raises(PromptTooLongError, match="maximum context length is 512.*500 in the prompt, 16"):
        llm.generate([PROMPTS[0], long], SamplingParams(max_tokens=16))
    _assert_idle(llm)  # the good prompt was not left queued or allocated


def test_request_larger_than_kv_cache(tiny_models):
    small = LLM(str(tiny_models["llama"]), head_layout="full", kv_cache_memory=2 * 2 * 2 * 16 * 16 * 4 * 3)
    with pytest.raises(RequestTooLargeError, match="holds at most 48 tokens"):
        small.generate("word " * 40, SamplingParams(max_tokens=16))
    _assert_idle(small)


def test_bad_model_paths_and_options(tmp_path, tiny_models):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    bad = tmp_path / "gpt"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(bad))
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(str(tiny_models["llama"]), kv_cache_mem=5)
    with pytest.raises(ConfigError, match="dtype"):
        LLM(str(tiny_models["llama"]), dtype="float16")


def test_bfloat16_runs_and_mostly_agrees(tiny_models):
    f32 = LLM(str(tiny_models["llama"]), head_layout="full", kv_cache_memory=1 << 24)
    assert f32.engine.dtype == torch.float32  # auto: the tiny checkpoint is saved in float32
    bf = LLM(str(tiny_models["llama"]), head_layout="full", kv_cache_memory=1 << 24, dtype="bfloat16")
    assert bf.engine.runner.kv.paged_k.dtype == torch.bfloat16
    ids = f32.tokenizer.encode(PROMPTS[1])
    a, b = f32.engine.prompt_logits(ids), bf.engine.prompt_logits(ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_follows_checkpoint_and_device(tiny_models, tmp_path, monkeypatch, native):
    """auto: bfloat16 for 16-bit or quantized checkpoints where the device computes it
    natively; float32 checkpoints, and devices without native bf16, stay float32."""
    import json
    import shutil

    import headwise.config as config_mod
    from headwise.config import EngineConfig
    from headwise.weights.loader import checkpoint_dtype

    monkeypatch.setattr(config_mod, "native_bf16", lambda device: native)
    want = torch.bfloat16 if native else torch.float32
    cfg = EngineConfig()
    assert cfg.resolve_dtype(None) == want  # GGUF
    assert cfg.resolve_dtype("bfloat16") == want
    assert cfg.resolve_dtype("float32") == torch.float32
    assert EngineConfig(dtype="float32").resolve_dtype(None) == torch.float32
    assert EngineConfig(dtype="bfloat16").resolve_dtype("float32") == torch.bfloat16

    bf_dir = tmp_path / "bf16"
    shutil.copytree(tiny_models["llama"], bf_dir)
    meta = json.loads((bf_dir / "config.json").read_text())
    meta.pop("dtype", None)
    meta["torch_dtype"] = "bfloat16"
    (bf_dir / "config.json").write_text(json.dumps(meta))
    assert checkpoint_dtype(str(bf_dir)) == "bfloat16"
    assert checkpoint_dtype(str(tiny_models["llama"])) == "float32"
    llm = LLM(str(bf_dir), head_layout="full", kv_cache_memory=1 << 24)
    assert llm.engine.dtype == want
    assert llm.engine.runner.kv.paged_k.dtype == want
    assert next(llm.engine.model.parameters()).dtype == want


def test_release_freed_heap_returns_pages_to_the_os():
    """What loading leaves behind: many small freed blocks, kept mapped by glibc until
    released."""
    from headwise.weights.loader import release_freed_heap

    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

    blocks = [bytearray(64 << 10) for _ in range(3000)]  # ~190 MiB of heap (below mmap size)
    pin = bytearray(64 << 10)  # allocated above them: glibc cannot just lower the heap top
    del blocks
    before = rss_kib()
    if not release_freed_heap():
        pytest.skip("no malloc_trim in this C library")
    assert before - rss_kib() > 100 << 10
    del pin
