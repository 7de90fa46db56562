"""Start-up: the prepared-weights cache (weights/prepared.py) gives the weights and tokens
preparing from the GGUF gives, per dtype and head order; a damaged entry is rebuilt;
entries are bounded; and a decode step compiled in the background takes over from eager
steps without changing a token."""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

from headwise import LLM, SamplingParams
from headwise.config import ConfigError, EngineConfig
from headwise.kernels import codes_gemm
from headwise.weights import prepared as P
from headwise.weights.loader import resolve_model_path
from tests.test_decode_capture import PROMPTS, GraphCalls, _mixed, _run

# The entries of the dense copies (dense_weights=True); the default keeps a bfloat16 CPU
# engine's weights as codes alone (test_codes_only_weights_have_their_own_entry...).
OPTS = dict(kv_cache_memory=1 << 28, max_num_seqs=4, enforce_eager=True, dense_weights=True)
CODES = dict(OPTS, dense_weights=False)
DEFAULT = dict(OPTS, dense_weights=None)
NEAR_TIE = 0.25  # nats between the dense weights' top two tokens that rounding may reorder


@pytest.fixture(scope="module")
def entry(tmp_path_factory):
    """A cache directory holding the default model's entry, the engine that wrote it and
    its greedy outputs (each engine's first run: a second would hit its prefix cache)."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEADWISE_CACHE_DIR", str(root))
        # Written whatever this machine's disk has free (test_a_full_disk_... covers the margin).
        mp.setattr(P, "MIN_FREE_BYTES", 0)
        mp.setattr(P, "MIN_FREE_FRACTION", 0.0)
        first = LLM(None, **OPTS)
        assert first.engine.prepared is not None and first.engine.prepared.writer is not None
        first.engine.prepared.writer.join()
        yield root / "prepared", first, _greedy(first)


@pytest.fixture
def cache(entry, monkeypatch):
    monkeypatch.setenv("HEADWISE_CACHE_DIR", str(entry[0].parent))
    return entry[0]


def _greedy(llm, n=12):
    """(tokens, their logprobs, the top two {token: logprob} at each step) per prompt."""
    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=2)
    return [(o.token_ids, list(o.logprobs), list(o.top_logprobs))
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _tensors(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in model.named_modules():
        for attr, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is not None:
                out[f"{name}.{attr}"] = t.detach()
        if getattr(m, "packed", None) is not None:
            out[f"{name}.packed"] = m.packed.to_dense()
    return out


def test_second_start_reads_the_entry_and_changes_nothing(entry, cache, caplog):
    _, first, want = entry
    assert {p.name for p in first.engine.prepared.dir.iterdir()} == {"manifest.json", "kept.bin", "dense.bin"}
    with caplog.at_level(logging.INFO, logger="headwise.prepared"):
        second = LLM(None, **OPTS)
    assert any("read from" in r.message for r in caplog.records)
    assert second.engine.prepared.writer is None  # nothing to write
    a, b = _tensors(first.engine.model), _tensors(second.engine.model)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert _greedy(second) == want
    off = LLM(None, prepared_weights_cache=False, **OPTS)
    assert off.engine.prepared is None
    assert _greedy(off) == want


def test_entries_are_per_dtype_and_head_order(entry, cache):
    shipped = entry[1].engine.prepared
    full = LLM(None, head_layout="full", **OPTS).engine.prepared  # another head order
    full.writer.join()
    assert full.key != shipped.key and {p.name for p in cache.iterdir()} == {shipped.key, full.key}
    path = resolve_model_path(None)
    order = [list(range(3))] * 30
    assert P.PreparedWeights(cache, path, torch.bfloat16, order).key == full.key
    assert P.PreparedWeights(cache, path, torch.float32, order).key != full.key
    shutil.rmtree(full.dir)


def test_a_damaged_entry_is_rebuilt(entry, cache, caplog):
    want, where = entry[2], entry[1].engine.prepared.dir
    with open(where / "kept.bin", "r+b") as f:
        f.truncate(1000)
    with caplog.at_level(logging.WARNING, logger="headwise.prepared"):
        again = LLM(None, **OPTS)
    assert any("do not read back" in r.message for r in caplog.records)
    again.engine.prepared.writer.join()  # written anew
    assert (where / "kept.bin").stat().st_size > 1000
    assert _greedy(again) == want
    (where / "manifest.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="headwise.prepared"):
        LLM(None, **OPTS).engine.prepared.writer.join()
    assert sum("do not read back" in r.message for r in caplog.records) == 2


def test_an_entry_another_process_deletes_while_it_is_read(entry, cache, monkeypatch, caplog):
    """Two engines starting at once (pytest's workers, two servers): one's eviction may
    delete the entry the other is reading. What the reader mapped or opened stays readable;
    one that had not opened its files yet prepares anew and writes the entry again."""
    want, where, read = entry[2], entry[1].engine.prepared.dir, P.PreparedWeights._read

    def read_then_deleted(self, cfg, manifest):
        model = read(self, cfg, manifest)
        shutil.rmtree(self.dir)
        return model

    monkeypatch.setattr(P.PreparedWeights, "_read", read_then_deleted)
    assert _greedy(LLM(None, **OPTS)) == want
    assert not where.exists()
    # the entry is written again by a start that prepared anew
    LLM(None, **OPTS).engine.prepared.writer.join()

    def deleted_then_read(self, cfg, manifest):
        shutil.rmtree(self.dir)
        return read(self, cfg, manifest)

    monkeypatch.setattr(P.PreparedWeights, "_read", deleted_then_read)
    with caplog.at_level(logging.INFO, logger="headwise.prepared"):
        llm = LLM(None, **OPTS)
    assert any("deleted while being read" in r.message for r in caplog.records)
    assert not any("do not read back" in r.message for r in caplog.records)
    llm.engine.prepared.writer.join()
    assert (where / "manifest.json").exists()
    assert _greedy(llm) == want


def test_eviction_keeps_the_bound_and_the_newest(tmp_path):
    for i, name in enumerate(["old", "mid", "new"]):
        d = tmp_path / name
        d.mkdir()
        (d / "kept.bin").write_bytes(b"x" * 1000)
        (d / "manifest.json").write_text("{}")
        os.utime(d / "manifest.json", (time.time() - 100 + i, time.time() - 100 + i))
    stale = tmp_path / ".tmp-dead"
    stale.mkdir()
    os.utime(stale, (time.time() - P.STALE_TMP_S - 10,) * 2)
    fresh = tmp_path / ".tmp-writing"
    fresh.mkdir()
    P._evict(tmp_path, 2100, keep=tmp_path / "new")
    # a writer that died on this host (its pid runs no more) is gone at once; a live one stays
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f".tmp-{'a' * 32}-{socket.gethostname()}-{dead.pid}-0123abcd").mkdir()
    (tmp_path / f".tmp-{'b' * 32}-{socket.gethostname()}-{os.getpid()}-0123abcd").mkdir()
    P._sweep(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        ".tmp-writing", f".tmp-{'b' * 32}-{socket.gethostname()}-{os.getpid()}-0123abcd", "mid", "new"])


def _entries(root, sizes: dict[str, int]) -> None:
    """Entries named by `sizes` (bytes of kept.bin), the first the least recently used."""
    for i, (name, size) in enumerate(sizes.items()):
        d = root / name
        d.mkdir()
        (d / "kept.bin").write_bytes(b"x" * size)
        (d / "manifest.json").write_text("{}")
        os.utime(d / "manifest.json", (time.time() - 100 + i,) * 2)


def _disk(monkeypatch, root, capacity: int) -> None:
    """A file system of 100 GiB whose free space is `capacity` less what root holds."""
    def usage(path):
        held = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        return shutil._ntuple_diskusage(100 << 30, held, capacity - held)
    monkeypatch.setattr(P.shutil, "disk_usage", usage)


def test_a_full_disk_evicts_for_room_or_skips_the_entry(tmp_path, monkeypatch, caplog):
    # the shipped margin (the module's `entry` fixture sets it to nothing while it lives)
    monkeypatch.setattr(P, "MIN_FREE_BYTES", 2 << 30)
    monkeypatch.setattr(P, "MIN_FREE_FRACTION", 0.05)
    _disk(monkeypatch, tmp_path, capacity=(5 << 30) + 2500)
    assert P.min_free_bytes(tmp_path) == 5 << 30  # 5% of the file system, being over 2 GiB
    _entries(tmp_path, {"old": 1000, "mid": 1000, "new": 300})
    # 200 bytes free over the margin: 700 more needed; the oldest entry alone makes room
    assert P._evict(tmp_path, P.PREPARED_BYTES, keep=tmp_path / "x", need_free=(5 << 30) + 900) >= (5 << 30) + 900
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mid", "new"]
    # more than deleting every entry would free: nothing is deleted, the entry is skipped
    w = P.PreparedWeights.__new__(P.PreparedWeights)
    w.root, w.dir = tmp_path, tmp_path / "big"
    with caplog.at_level(logging.WARNING, logger="headwise.prepared"):
        w.save([("m", "w", torch.zeros(3000, dtype=torch.uint8), "parameter")], cfg=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mid", "new"]
    assert "would leave less than 5.0 GiB free" in caplog.text


def test_background_compile_takes_over_without_changing_tokens(tiny_models):
    """Steps run eagerly while the decode step compiles on its thread, then the graph."""
    opts = dict(head_layout=_mixed(), kv_cache_memory=1 << 24, dtype="float32", block_size=4)
    path = str(tiny_models["llama"])
    eager = LLM(path, enforce_eager=True, **opts)
    bg = LLM(path, enforce_eager=False, compile_in_background=True, **opts)
    cap = bg.engine.runner.forward
    assert cap.enabled and cap.compiler is not None
    want = _run(eager, PROMPTS)
    early = _run(bg, PROMPTS)  # before or while the compile runs
    assert cap.wait() and cap.compile_s > 0 and not cap.compiler.is_alive()
    calls = GraphCalls(bg)
    late = _run(bg, PROMPTS)
    assert calls.sizes, "the compiled graph did not run once the compile finished"
    for got in (early, late):
        for a, b in zip(want, got):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_flags_are_checked():
    for name in ("compile_in_background", "prepared_weights_cache", "dense_weights"):
        with pytest.raises(ConfigError, match=name):
            EngineConfig(**{name: "yes"})


def test_dense_copies_by_default_only_where_the_codes_cannot_serve():
    """dense_weights=None (the default): quantized weights keep prepacked dense copies only
    where their codes cannot serve every matmul (another dtype than bfloat16, no kernels
    over codes; the kernels are asked last); True and False are kept as given."""
    asked = []

    def kernels(there: bool):
        return lambda: asked.append(there) or there

    cfg = EngineConfig()
    assert cfg.dense_weights is None
    assert not cfg.keeps_dense_weights(torch.bfloat16, kernels(True))
    assert cfg.keeps_dense_weights(torch.bfloat16, kernels(False))
    assert asked == [True, False]
    assert cfg.keeps_dense_weights(torch.float32, kernels(True))
    assert EngineConfig(dense_weights=True).keeps_dense_weights(torch.bfloat16, kernels(True))
    assert not EngineConfig(dense_weights=False).keeps_dense_weights(torch.float32, kernels(False))
    assert asked == [True, False]  # not asked where the dtype or the option decides


def test_tiny_hf_models_are_not_cached(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWISE_CACHE_DIR", str(tmp_path))
    cache = tmp_path / "prepared"
    llm = LLM(str(tiny_models["llama"]), head_layout=_mixed(), kv_cache_memory=1 << 24, dtype="float32",
              block_size=4, enforce_eager=True)
    assert llm.engine.prepared is None and not cache.exists()


def test_codes_only_weights_have_their_own_entry_and_answer_alike(entry, cache, caplog):
    """dense_weights=False: the 4-bit weights keep no bfloat16 copy (prefill multiplies with
    their codes), in an entry of its own that reads back to the same tensors and tokens;
    it answers as the dense copies do (the weights differ by the rounding of their bfloat16
    scales only). The default engine is this one where the kernels over codes run, the
    dense one elsewhere."""
    dense = entry[1].engine
    with pytest.raises(ConfigError, match="dense_weights=False"):
        LLM(None, **dict(CODES, dtype="float32"))
    if dense.dtype != torch.bfloat16:  # a CPU without AVX512-BF16: "auto" is float32 there
        with pytest.raises(ConfigError, match="needs bfloat16"):
            LLM(None, **CODES)
        assert LLM(None, **DEFAULT).engine.prepared.key == dense.prepared.key
        return
    first = LLM(None, **CODES)
    eng = first.engine
    assert eng.prepared.key != dense.prepared.key
    eng.prepared.writer.join()
    lins = [m for m in eng.model.modules() if isinstance(m, P.Linear)]
    packed = {n for n, m in eng.model.named_modules() if isinstance(m, P.Linear) and m.packed is not None}
    # SmolLM2's projections are all Q4_1, its vocabulary projection (tied to the embedding)
    # Q8_0: each reads its codes, so nothing is packed and no dense embedding is kept.
    assert packed == set() and sum(m.codes_only for m in lins) == 61
    assert eng.model.model.embed_tokens.weight is None and eng.model.lm_head.int8_codes is not None
    size = {p.name: p.stat().st_size for p in eng.prepared.dir.iterdir()}
    assert size["dense.bin"] == 0  # 269 MB with dense copies
    want = _greedy(first)
    with caplog.at_level(logging.INFO, logger="headwise.prepared"):
        second = LLM(None, **CODES)
    assert any("read from" in r.message for r in caplog.records)
    a, b = _tensors(eng.model), _tensors(second.engine.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _greedy(second) == want
    for prompt, (codes, _, _), (dense_ids, _, dense_top) in zip(PROMPTS, want, entry[2]):
        # The same greedy tokens up to a near-tie of the dense weights' own choice, which the
        # scales' rounding may flip (on an AMD EPYC one prompt's 5th token: 0.125 nats apart);
        # past it the two continue from different text.
        i = next((i for i, (a, b) in enumerate(zip(codes, dense_ids)) if a != b), None)
        if i is not None:
            assert codes[i] in dense_top[i] and dense_top[i][dense_ids[i]] - dense_top[i][codes[i]] < NEAR_TIE
        # Teacher-forced along the dense answer, every token's logprob within 0.5 nats (0.21
        # at most on that EPYC); codes read wrongly would be off by several nats.
        ids = dense.tokenizer.encode(prompt) + dense_ids
        assert (eng.prompt_logprobs(ids) - dense.prompt_logprobs(ids)).abs().max() < 0.5
    default = LLM(None, **DEFAULT).engine
    assert default.prepared.key == (eng.prepared.key if codes_gemm.available() else dense.prepared.key)
    shutil.rmtree(eng.prepared.dir)
