"""Gemma 3: a tiny random model against transformers (sandwich norms, q/k norm, GeGLU,
scaled embeddings, query_pre_attn_scalar, sliding layers with their own rotary base), the
native layout and the checks on other layouts, the GGUF reader, and the real 270M GGUF
against transformers on the same file."""
import json

import numpy as np
import pytest
import torch

from headwise import LLM, HeadLayout, SamplingParams
from headwise.heads.layout import HeadSpec, LayoutError
from headwise.config import ConfigError
from headwise.models.config import ModelConfig, gemma3_layer_types
from headwise.tokenizer import DIRECT_MARK, Tokenizer, _check_direct, _direct_load, _direct_verdict, _same_tokenizer, _versions
from headwise.weights.loader import default_model_path
from headwise.weights.gguf_file import GGUFFile, GGUFFormatError
from tests.conftest import assert_batched_equals_single, make_tiny_model

WINDOW = 16
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
# head_dim 256 as in every Gemma 3; the scale 1/sqrt(192) differs from 1/sqrt(head_dim).
TINY = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
            sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=192,
            tie_word_embeddings=True, max_position_embeddings=512)
PROMPT = "The history of the city begins with a small settlement on the river, where"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory, tokenizer_dir):
    return make_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"), tokenizer_dir, **TINY)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _options(backend: str) -> dict:
    if backend == "triton":
        pytest.importorskip("triton")
        return dict(attention_backend="triton", device=KERNEL_DEVICE, block_size=4)
    return dict(attention_backend="torch", block_size=4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_logits_match_hf(tiny_gemma, backend):
    llm = LLM(str(tiny_gemma), kv_cache_memory=1 << 24, dtype="float32", **_options(backend))
    assert llm.engine.layout.name == "native"
    ids = llm.tokenizer.encode(PROMPT * 4)
    assert len(ids) > 3 * WINDOW  # the sliding layers drop tokens
    with torch.no_grad():
        ref = _hf(tiny_gemma)(torch.tensor([ids])).logits[0]
    for chunk in (len(ids), 7):  # one pass, and chunks that cross the window
        ours = llm.engine.prompt_logits(ids, chunk_size=chunk)
        assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_greedy_matches_hf(tiny_gemma, backend):
    llm = LLM(str(tiny_gemma), kv_cache_memory=1 << 24, dtype="float32", **_options(backend))
    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = _hf(tiny_gemma).generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == ref
    assert len(set(ref)) > 3  # not stuck on one token
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0)
    assert_batched_equals_single(llm, [PROMPT, PROMPT * 2, "A short one"], params)


def test_native_layout_and_its_checks(tiny_gemma):
    llm = LLM(str(tiny_gemma), kv_cache_memory=1 << 24, dtype="float32")
    lay = llm.engine.layout
    for l, kind in enumerate(LAYER_TYPES):
        want = HeadSpec("window", 0, WINDOW) if kind == "sliding_attention" else HeadSpec("full")
        assert lay.heads[l] == [want, want]
    assert llm.engine.max_model_len == 512  # not clamped to the window: the layout models it
    shape = lay.shape
    with pytest.raises(LayoutError, match="sliding window"):
        LLM(str(tiny_gemma), head_layout="full", kv_cache_memory=1 << 24)
    wider = HeadLayout("wider", *shape, [[HeadSpec("window", 0, 2 * WINDOW)] * 2 if t == "sliding_attention"
                                         else [HeadSpec("full")] * 2 for t in LAYER_TYPES])
    with pytest.raises(LayoutError, match="layer 0 KV head 0"):
        LLM(str(tiny_gemma), head_layout=wider, kv_cache_memory=1 << 24)
    with pytest.raises(ConfigError, match="rotary base"):
        LLM(str(tiny_gemma), window_positions="rebased", kv_cache_memory=1 << 24)
    # A calibrated layout may give a full-attention layer's heads sink + window.
    heads = [list(r) for r in lay.heads]
    heads[2] = [HeadSpec("full"), HeadSpec("window", 4, 8)]
    split = LLM(str(tiny_gemma), head_layout=HeadLayout("split", *shape, heads), kv_cache_memory=1 << 24,
                dtype="float32")
    ids = split.tokenizer.encode(PROMPT * 2)
    out = split.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_config_defaults_and_errors():
    assert [i for i, t in enumerate(gemma3_layer_types(18)) if t == "full_attention"] == [5, 11, 17]
    base = dict(model_type="gemma3_text", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=12, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                sliding_window=32)
    cfg = ModelConfig.from_hf(base)  # no layer_types, no rotary bases: Gemma 3's defaults
    assert cfg.architecture == "gemma3" and cfg.sliding_layers == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert cfg.rope_theta_of(0) == 10000.0 and cfg.rope_theta_of(5) == cfg.rope_theta == 1e6
    assert cfg.hidden_act == "gelu_tanh" and cfg.attention_scale == 1 / 16  # transformers' default scalar, 256
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf(dict(base, layer_types=["sliding_attention"] * 3))
    with pytest.raises(ValueError, match="activation"):
        ModelConfig.from_hf(dict(base, hidden_activation="relu"))
    with pytest.raises(ValueError, match="multimodal"):
        ModelConfig.from_hf({"model_type": "gemma3", "text_config": base, "vision_config": {}})


def test_gguf_reader_matches_gguf_package(tmp_path):
    from gguf import GGUFReader

    path = default_model_path()
    ours, ref = GGUFFile(path), GGUFReader(str(path))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.get(key)
        if isinstance(want, list) and want and isinstance(want[0], str):
            assert len(got) == len(want)  # string arrays are counted, not decoded
        else:
            assert (list(got) if isinstance(got, np.ndarray) else got) == want, key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors[:12], ref.tensors[:12]):
        from gguf.quants import dequantize

        want = dequantize(b.data, b.tensor_type).reshape(tuple(reversed(b.shape.tolist())))
        assert np.array_equal(a.dequantize(), want)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(GGUFFormatError, match="truncated"):
        GGUFFile(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        GGUFFile(bad)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="empty, not a GGUF"):
        GGUFFile(tmp_path / "empty.gguf")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_tensors_dequantize_as_the_gguf_package_does(qtype, monkeypatch):
    """Chunked over threads (chunks of a few rows here, so there are many), every value
    equals gguf.quants.dequantize's; without gguf's per-type table, its function is used."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES

    from headwise.weights import gguf_file
    from headwise.weights.gguf_file import GGUFTensor

    block, size = GGML_QUANT_SIZES[Q[qtype]]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (37, 2 * size), dtype=np.uint8)  # 37 rows of 2 blocks
    for b in range(2):  # finite float16 scales wherever the format keeps them
        for at in ([0, 2] if qtype in ("Q4_1", "Q4_K", "Q5_K") else [0] if qtype in ("Q8_0", "Q5_0") else [size - 2]):
            raw[:, b * size + at: b * size + at + 2] = (rng.random(37) * 1e-2).astype(np.float16).view(np.uint8).reshape(-1, 2)
    tensor = GGUFTensor("w", (2 * block, 37), Q[qtype], raw)
    want = quants.dequantize(raw, Q[qtype]).reshape(37, 2 * block)
    monkeypatch.setattr(gguf_file, "DEQUANT_CHUNK_BYTES", 3 * size)
    assert np.array_equal(tensor.dequantize(), want)
    monkeypatch.setattr(gguf_file, "_format_code", lambda qtype: None)
    assert np.array_equal(tensor.dequantize(), want)


def test_unknown_model_name_lists_known_ones():
    with pytest.raises(FileNotFoundError, match="gemma-3-270m"):
        LLM("gemma-3-999m")


# ---- the real model: Gemma 3 270M (base), GGUF Q4_K_M from PyPI -------------------------
@pytest.fixture(scope="module")
def gemma_f32():
    # Eager: compiled decode equals eager decode (tests/test_decode_capture.py, tiny Gemma 3
    # included); compiling this model's step would add ~15-25 s.
    return LLM("gemma-3-270m", dtype="float32", kv_cache_memory=1 << 30, max_num_batched_tokens=1024,
               enforce_eager=True)


def _prose_ids(tokenizer, n: int) -> list[int]:
    from headwise.evaluation.tasks import prose_sentences

    ids = tokenizer.encode(" ".join(prose_sentences()[:2000]))
    assert len(ids) >= n
    return ids[:n]


def test_gemma_270m_matches_transformers_on_the_same_gguf(gemma_f32):
    from transformers import AutoModelForCausalLM

    from headwise.weights.registry import gemma3_270m_path

    path = gemma3_270m_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    ids = _prose_ids(gemma_f32.tokenizer, 2100)
    # Three 1024-token chunks, each past the sliding layers' window; then decode past
    # SPLIT_MIN_LEN, where the full heads are attended in pieces.
    ours = gemma_f32.engine.prompt_logits(ids, positions=[2099])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert (ours[0] - ref.logits[0][0]).abs().max().item() < 1e-4  # the prompt's last token
    want = ref.sequences[0, len(ids):].tolist()
    got = gemma_f32.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    assert got == want


def test_gemma_270m_chunked_4k_prefill_equals_one_pass():
    # bfloat16 here; eager: prefill only, no decode step to compile. 4K: eight sliding
    # windows, four chunks (make bench-gemma runs it to 32K)
    llm = LLM("gemma-3-270m", kv_cache_memory=1 << 30, max_num_batched_tokens=4096, enforce_eager=True)
    # Decode reads every projection as its GGUF stores it: q/k/v/gate/up (Q5_0, Q8_0) and
    # Q6_K ffn_down as int8 codes, attn_output and Q4_K ffn_down as 4-bit codes.
    layers = llm.engine.model.model.layers
    assert all(layer.self_attn.o_proj.int4 is not None for layer in layers)
    assert all((layer.mlp.down_proj.int4 is None) != (layer.mlp.down_proj.int8_codes is None) for layer in layers)
    assert all(layer.mlp.up_proj.int8_codes is not None for layer in layers)
    ids = _prose_ids(llm.tokenizer, 4096)
    one = llm.engine.prompt_logits(ids, chunk_size=4096, positions=[4095])
    chunked = llm.engine.prompt_logits(ids, chunk_size=1024, positions=[4095])
    assert (one - chunked).abs().max().item() < 0.01 * one.abs().max().item()
    assert one.argmax() == chunked.argmax()


@pytest.mark.parametrize("method", ["ablation", "gates"])
def test_calibration_keeps_the_sliding_layers_native(tiny_gemma, tmp_path, method):
    from headwise.calibration import calibrate
    from headwise.calibration.calibrate import select_from_scores

    lay = calibrate(str(tiny_gemma), full_fraction=0.5, sink=2, window=4, num_samples=2,
                    lengths=(96,), rounds=1, progress=False, engine_options={"dtype": "float32"},
                    method=method, steps=3)
    native = HeadSpec("window", 0, WINDOW)
    for l, kind in enumerate(LAYER_TYPES):
        if kind == "sliding_attention":
            assert lay.heads[l] == [native, native] and lay.scores[l] == [None, None]
    assert sorted(s.kind for s in lay.heads[2]) == ["full", "window"]  # 50% of the 2 candidates
    assert all(x is not None for x in lay.scores[2])
    f = tmp_path / "cal.json"
    lay.save(f)
    again = select_from_scores(HeadLayout.load(f), 0.0, sink=2, window=8)
    assert again.heads[2] == [HeadSpec("window", 2, 8)] * 2 and again.heads[0] == [native, native]
    llm = LLM(str(tiny_gemma), head_layout=again, kv_cache_memory=1 << 24)  # passes the native check
    assert llm.engine.layout.num_paged(2) == 0


def test_eval_uses_the_native_layout_as_reference(tiny_gemma):
    from headwise.evaluation.suite import run_eval

    records, text = run_eval(str(tiny_gemma), None, ["ppl", "agreement"], [96], 1, False, None, None,
                             engine_options=dict(kv_cache_memory=1 << 24, dtype="float32"))
    assert {r.layout for r in records} == {"native"}
    assert [r.score for r in records if r.task == "agreement"] == [1.0]
    ppl = next(r.score for r in records if r.task == "ppl")
    llm = LLM(str(tiny_gemma), dtype="float32", kv_cache_memory=1 << 24)
    from headwise.evaluation.runner import prose_text

    ids = llm.tokenizer.encode(prose_text())[:96]
    logits = llm.engine.prompt_logits(ids)
    want = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).exp().item()
    assert abs(ppl - want) < 1e-3 * want
    lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (llm.engine.prompt_logprobs(ids, chunk_size=7) - lp).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="sliding-window"):
        run_eval(str(tiny_gemma), None, ["ppl"], [96], 1, True, None, None,
                 engine_options=dict(kv_cache_memory=1 << 24))


def test_transformers_reference_row(tiny_gemma):
    from headwise.evaluation.reference import TransformersReference
    from headwise.evaluation.suite import run_eval

    params = SamplingParams(max_tokens=12, stop=["\n\n"])
    ref = TransformersReference(str(tiny_gemma), torch.float32).generate([PROMPT * 2], params)[0]
    ours = LLM(str(tiny_gemma), dtype="float32", kv_cache_memory=1 << 24).generate([PROMPT * 2], params)[0]
    assert ref.text == ours.text
    records, text = run_eval(str(tiny_gemma), None, ["niah", "ppl"], [96], 1, False, None, None,
                             engine_options=dict(kv_cache_memory=1 << 24, dtype="float32"), transformers=True)
    hf = [r for r in records if r.layout == "transformers"]
    assert {r.task for r in hf} == {"niah"} and len(hf) == 5  # one per depth; no perplexity
    assert text.splitlines()[0] == "| task | length | native | transformers |"


def test_peer_benchmark_counts_sliding_caches(tiny_gemma, tmp_path):
    from benchmarks import peers

    hf = peers.make("transformers", str(tiny_gemma), 256, dtype="float32")
    native = peers.make("headwise-native", str(tiny_gemma), 256, dtype="float32")
    for L in (16, 160, 256):  # within and past the window, whole blocks
        assert native.kv_bytes(L) == hf.kv_bytes(L)  # both keep the window in sliding layers
    lay = tmp_path / "mine.json"
    heads = [list(r) for r in native.llm.engine.layout.heads]
    heads[2] = [HeadSpec("window", 2, 8)] * 2
    HeadLayout("mine", *native.llm.engine.layout.shape, heads).save(lay)
    mine = peers.make(f"headwise@{lay}", str(tiny_gemma), 256, dtype="float32")
    assert mine.name == "headwise-mine" and mine.kv_bytes(256) < native.kv_bytes(256)
    with pytest.raises(peers.Skip, match="sliding-window"):
        peers.make("headwise-full", str(tiny_gemma), 256, dtype="float32")


def test_prefix_cache_int8_and_server_on_gemma(tiny_gemma):
    from fastapi.testclient import TestClient

    from headwise.server.app import create_app

    doc = PROMPT * 4
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)
    cold = LLM(str(tiny_gemma), dtype="float32", kv_cache_memory=1 << 24, block_size=4,
               enable_prefix_caching=False).generate([doc + " First"], params)[0]
    llm = LLM(str(tiny_gemma), dtype="float32", kv_cache_memory=1 << 24, block_size=4)
    llm.generate([doc + " Second"], params)
    hit = llm.generate([doc + " First"], params)[0]
    assert hit.num_cached_tokens > 3 * WINDOW  # past the window: ring snapshots were restored
    assert hit.token_ids == cold.token_ids
    assert max(abs(a - b) for a, b in zip(hit.logprobs, cold.logprobs)) < 1e-4
    q = LLM(str(tiny_gemma), dtype="float32", kv_cache_memory=1 << 24, kv_cache_dtype="int8")
    assert q.kv_bytes(256) < 0.3 * llm.kv_bytes(256)  # int8 + a float32 scale per 256 values
    assert len(q.generate([doc], params)[0].token_ids) == 12
    client = TestClient(create_app(llm.engine))
    r = client.post("/v1/completions", json={"prompt": doc + " First", "max_tokens": 12, "temperature": 0,
                                              "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == cold.text


def test_gguf_tokenizer_is_cached_once(tmp_path):
    path = default_model_path()
    text = "Hello world, the special magic number for Paris is 12345.\n\nünïcode 日本"
    first = Tokenizer.from_path(path.parent, path.name, cache=tmp_path)
    saved = list((tmp_path / "tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer_config.json").is_file()
    again = Tokenizer.from_path(path.parent, path.name, cache=tmp_path)
    assert again.encode(text) == first.encode(text) and again.eos_token_id == first.eos_token_id
    assert again.decode(first.encode(text)) == first.decode(first.encode(text))
    assert again.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        first.apply_chat_template([{"role": "user", "content": "hi"}])
    # The entry was checked to load directly (the Rust tokenizer from its tokenizer.json),
    # and is reloaded that way, as transformers' class would have built it.
    mark = saved[0] / DIRECT_MARK
    assert json.loads(mark.read_text()) == {"versions": _versions(), "same": True}
    assert again.hf.get_vocab() == first.hf.get_vocab() and type(again.hf).__name__ == "TokenizersBackend"
    mark.write_text(json.dumps({"versions": {"transformers": "0.0"}, "same": True}))  # other versions: not trusted,
    assert _direct_verdict(saved[0]) is None
    assert Tokenizer.from_path(path.parent, path.name, cache=tmp_path).encode(text) == first.encode(text)
    assert _direct_verdict(saved[0]) is True  # checked again by these
    (saved[0] / "tokenizer_config.json").write_text("{not json")  # a damaged cache entry is rebuilt
    assert Tokenizer.from_path(path.parent, path.name, cache=tmp_path).encode(text) == first.encode(text)


def test_tokenizer_by_type_is_the_one_autotokenizer_builds():
    """weights.loader.TOKENIZER_TYPES for Gemma 3: naming the type skips AutoTokenizer's
    config pass over the file (16 s here); the tokenizer is the same as without it."""
    from transformers import AutoTokenizer

    from headwise.tokenizer import _same_tokenizer
    from headwise.weights.loader import TOKENIZER_TYPES
    from headwise.weights.registry import gemma3_270m_path

    path = gemma3_270m_path()
    fast = Tokenizer.from_path(path.parent, path.name, tokenizer_type=TOKENIZER_TYPES["gemma3"]).hf
    auto = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(fast) is type(auto) and _same_tokenizer(auto, fast)


def test_a_direct_load_that_differs_is_not_trusted(tmp_path):
    path = default_model_path()
    hf = Tokenizer.from_path(path.parent, path.name, cache=tmp_path).hf
    saved = next((tmp_path / "tokenizers").iterdir())
    assert _same_tokenizer(hf, _direct_load(saved))
    (saved / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # another template
    assert not _same_tokenizer(hf, _direct_load(saved))
    (saved / "chat_template.jinja").unlink()
    cfg = json.loads((saved / "tokenizer_config.json").read_text())
    (saved / "tokenizer_config.json").write_text(json.dumps(dict(cfg, eos_token="<|endoftext|>")))  # another eos
    assert not _same_tokenizer(hf, _direct_load(saved))
    _check_direct(hf, saved)
    assert _direct_verdict(saved) is False  # recorded: not compared again at every start


def test_native_keyword_resolves_for_any_model():
    from headwise.heads.layout import resolve_layout
    from headwise.layouts import native_layout

    cfg = ModelConfig.from_hf(dict(model_type="gemma3_text", vocab_size=10, hidden_size=8, intermediate_size=16,
                                   num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=4, sliding_window=32))
    native = native_layout(cfg)
    assert resolve_layout("native", native.shape, cfg.name, native=native) is native
    plain = resolve_layout("native", (2, 3, 4), "llama")  # no sliding layers: every head full
    assert plain.full_fraction == 1.0 and plain.shape == (2, 3, 4)
