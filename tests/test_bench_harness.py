"""The peer benchmark harness on a tiny model, one short run (no timing thresholds)."""
import json
import sys
import types

import pytest
import torch

from benchmarks import bench_peers, peers


def test_harness_records_ratios_and_skips(tiny_models, tmp_path):
    # One context: one spawned process per system and context (the next test covers several).
    out = tmp_path / "bench"
    rc = bench_peers.main(["--model", str(tiny_models["llama"]), "--layout", "window", "--contexts", "128",
                           "--runs", "1", "--budget-gib", "0.001", "--new-tokens", "2", "--agg-steps", "2",
                           "--systems", "headwise,headwise-select,headwise-int8,headwise-full,transformers,llama.cpp",
                           "--out-dir", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["dtype"] == "float32"  # auto: the tiny checkpoint is float32
    recs = res["records"]
    assert {r["system"] for r in recs} == {"headwise", "headwise-int8", "headwise-full", "transformers"}
    for r in recs:
        for f in bench_peers.FIELDS:
            assert f in r, f
        assert r["ttft_s"] > 0 and r["decode_tok_s"] > 0 and r["max_concurrency"] >= 1
        assert r["agg_tok_s"] > 0 and r["peak_rss_bytes"] > 0
    assert "llama.cpp" in res["skipped"]  # an HF directory has no GGUF for llama.cpp
    assert "no layout with select heads" in res["skipped"]["headwise-select"]
    md = (out / "results.md").read_text()
    assert "llama.cpp: skipped" in md
    assert (out / "results.png").stat().st_size > 0
    # the window layout stores far less KV than full at 128 tokens, and ratios say so
    by = {(r["system"], r["context"]): r for r in recs}
    me, full = by[("headwise", 128)], by[("headwise-full", 128)]
    rt = bench_peers.ratios(me, full)
    assert rt["kv"] == full["kv_bytes_per_seq"] / me["kv_bytes_per_seq"]
    assert rt["concurrency"] == me["max_concurrency"] / full["max_concurrency"]
    assert rt["ttft"] == full["ttft_s"] / me["ttft_s"]
    assert f"| 128 | headwise-full | {rt['ttft']:.2f}x" in md
    # int8 KV: float32 values become int8 plus one float32 scale per token and head
    D = 16
    assert by[("headwise-int8", 128)]["kv_bytes_per_seq"] * 4 * D == me["kv_bytes_per_seq"] * (D + 4)


def test_each_system_and_context_runs_in_its_own_process(tiny_models, tmp_path, monkeypatch):
    """Peak RSS is per process: one process per (system, context), and a skipped system is
    not retried at the next context."""
    calls = []

    def in_process(fn, *args):
        name, context = args[0], args[4]
        calls.append((name, context))
        return fn(*args)

    monkeypatch.setattr(bench_peers, "in_fresh_process", in_process)
    rc = bench_peers.main(["--model", str(tiny_models["llama"]), "--layout", "window", "--contexts", "64,128",
                           "--runs", "1", "--budget-gib", "0.001", "--new-tokens", "2", "--agg-steps", "2",
                           "--systems", "llama.cpp,headwise", "--out-dir", str(tmp_path)])
    assert rc == 0
    assert calls == [("llama.cpp", 64), ("headwise", 64), ("headwise", 128)]
    recs = json.loads((tmp_path / "results.json").read_text())["records"]
    assert [(r["system"], r["context"]) for r in recs] == [("headwise", 64), ("headwise", 128)]


def test_ratio_of_zero_is_infinite_not_a_crash():
    a = {"ttft_s": 1.0, "decode_tok_s": 2.0, "kv_bytes_per_seq": 10, "max_concurrency": 2, "agg_tok_s": 4.0}
    b = dict(a, agg_tok_s=0.0)
    assert bench_peers.ratios(a, b)["aggregate"] == float("inf")


def test_llama_cpp_compared_at_its_best_setting_per_figure():
    """With flash attention on and off both run, the ratio row for llama.cpp takes each
    figure from the setting that did better on it, and names that setting."""
    rng = {"ttft_s": [0, 0], "decode_tok_s": [0, 0], "agg_tok_s": [0, 0]}

    def rec(system, ttft, dec, agg, conc=10):
        return {"system": system, "context": 8192, "ttft_s": ttft, "decode_tok_s": dec, "agg_tok_s": agg,
                "kv_bytes_per_seq": 2**20, "max_concurrency": conc, "peak_rss_bytes": 2**30, "range": rng}

    me = rec("headwise", 2.0, 40.0, 200.0, conc=40)
    fa, nofa = rec("llama.cpp-fa", 10.0, 30.0, 90.0), rec("llama.cpp-nofa", 16.0, 36.0, 80.0)
    rt, won = bench_peers.best_ratios(me, [fa, nofa])
    assert rt["ttft"] == 5.0 and won["ttft"] == "llama.cpp-fa"        # fa prefills faster
    assert rt["decode"] == 40.0 / 36.0 and won["decode"] == "llama.cpp-nofa"
    assert rt["aggregate"] == 200.0 / 90.0 and won["aggregate"] == "llama.cpp-fa"
    assert rt["concurrency"] == 4.0 and won["concurrency"] == "llama.cpp-fa/llama.cpp-nofa"  # a tie
    md = bench_peers.ratio_table([me, fa, nofa], {}, "headwise")
    assert "| 8192 | llama.cpp at its best | 5.00x (fa) | 1.11x (nofa) | 1.00x (fa/nofa) |" in md
    # one setting alone: no best-of row
    assert "at its best" not in bench_peers.ratio_table([me, fa], {}, "headwise")
    # its q8_0 KV cache is one more setting: half the KV, so it wins KV and concurrency
    q8 = dict(rec("llama.cpp-fa-q8", 11.0, 29.0, 95.0, conc=20), kv_bytes_per_seq=2**19)
    rt, won = bench_peers.best_ratios(me, [fa, nofa, q8])
    assert (rt["kv"], won["kv"]) == (0.5, "llama.cpp-fa-q8") and won["concurrency"] == "llama.cpp-fa-q8"
    assert (rt["ttft"], won["ttft"]) == (5.0, "llama.cpp-fa")
    assert "| 8192 | llama.cpp at its best | 5.00x (fa) | 1.11x (nofa) | 0.50x (fa-q8) | 2.00x (fa-q8) |" in \
        bench_peers.ratio_table([me, fa, nofa, q8], {}, "headwise")


def test_llama_cpp_q8_kv_counts_its_blocks(monkeypatch):
    """llama.cpp-fa-q8's KV bytes are q8_0 blocks (34 bytes per 32 values), f16's 2 a value;
    q8_0 without flash attention is refused, as llama.cpp refuses a quantized V cache."""
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))  # only its presence is checked
    f16, q8 = peers.make("llama.cpp-fa", None, 8192), peers.make("llama.cpp-fa-q8", None, 8192)
    assert (f16.name, q8.name) == ("llama.cpp-fa", "llama.cpp-fa-q8")
    values = 30 * 1000 * 2 * 3 * 64  # SmolLM2: 30 layers, K and V, 3 KV heads of 64 dims
    assert f16.kv_bytes(1000) == values * 2 and q8.kv_bytes(1000) == values * 34 // 32
    with pytest.raises(ValueError, match="flash attention"):
        peers.LlamaCppSystem(None, 8192, flash=False, q8_kv=True)


def test_results_of_runs_merge_and_bad_merge_input_is_refused(tmp_path):
    """Records of an earlier run join this run's tables; a system and context measured
    again replaces its earlier record; a file that is not a results.json is refused."""
    rng = {"ttft_s": [1, 1], "decode_tok_s": [1, 1], "agg_tok_s": [1, 1]}

    def rec(system, L, ttft, rss=2**30):
        return {"system": system, "context": L, "ttft_s": ttft, "decode_tok_s": 10.0, "agg_tok_s": 20.0,
                "kv_bytes_per_seq": 2**20, "max_concurrency": 4, "peak_rss_bytes": rss, "range": rng}

    old = tmp_path / "old"
    old.mkdir()
    bench_peers.write_results(old, [rec("headwise", 8192, 3.0), rec("llama.cpp-fa", 8192, 9.0, rss=None)],
                              {}, "bfloat16", 2.0, 1, "headwise")
    earlier = bench_peers.load_records(old / "results.json")
    assert [r["system"] for r in earlier] == ["headwise", "llama.cpp-fa"] and all(r["date"] for r in earlier)
    both = bench_peers.merged(earlier, [rec("headwise", 8192, 2.0), rec("headwise", 16384, 5.0)])
    assert [(r["system"], r["context"], r["ttft_s"]) for r in both] == [
        ("llama.cpp-fa", 8192, 9.0), ("headwise", 8192, 2.0), ("headwise", 16384, 5.0)]
    md = bench_peers.write_results(tmp_path, both, {}, "bfloat16", 2.0, 1, "headwise")
    assert "| 8192 | llama.cpp-fa | 9.00 [1.00-1.00] | 10.0 [1.0-1.0] | 1.0 | 4 | 20.0 [1.0-1.0] | n/a |" in md
    assert "| 8192 | llama.cpp-fa | 4.50x |" in md  # against this run's headwise at 8K
    bad = tmp_path / "bad.json"
    bad.write_text('{"records": [{"system": "x"}]}')
    with pytest.raises(SystemExit, match="records lack"):
        bench_peers.load_records(bad)
    bad.write_text("not json")
    with pytest.raises(SystemExit, match="not a results.json"):
        bench_peers.load_records(bad)


def test_gpu_benchmark_harness_on_cpu(tmp_path):
    """benchmarks/gpu.py end to end with a tiny random model on CPU: both layouts, every
    field, the split layout stores less KV and fits more sequences, table ratios agree."""
    from benchmarks import gpu

    out = tmp_path / "gpu"
    rc = gpu.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--backend", "torch",
                   "--contexts", "128,300", "--budget-gib", "0.01", "--chunk", "64", "--new-tokens", "3",
                   "--agg-steps", "2", "--sink", "8", "--window", "16", "--no-kernels", "--out-dir", str(out),
                   "--layouts", "full,split,split+int8", "--capture"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    by = {(r["layout"], r["context"]): r for r in res["records"]}
    assert set(by) == {(l, c) for l in ("full", "split", "split+int8") for c in (128, 300)}
    assert by[("split+int8", 300)]["kv_bytes_per_seq"] < by[("split", 300)]["kv_bytes_per_seq"]
    for r in by.values():
        assert r["ttft_s"] > 0 and r["decode_tok_s"] > 0 and r["agg_tok_s"] > 0
    f, s = by[("full", 300)], by[("split", 300)]
    assert s["kv_bytes_per_seq"] < f["kv_bytes_per_seq"] and s["max_concurrency"] > f["max_concurrency"]
    md = (out / "results.md").read_text()
    assert f"| 300 | split | {f['ttft_s'] / s['ttft_s']:.2f}x | {f['kv_bytes_per_seq'] / s['kv_bytes_per_seq']:.2f}x |" in md
    # Decode eager, graphs, graphs + compile: no CUDA graphs on the CPU; float32 compiled
    # because enforce_eager=False, with eager's tokens.
    eager, graphs, compiled = res["capture"]
    assert [c["mode"] for c in res["capture"]] == ["eager", "graphs", "graphs+compile"]
    assert not any(c["graphs"] or c["capture_s"] for c in res["capture"])
    assert eager["compile_s"] == 0 == graphs["compile_s"] and compiled["compile_s"] > 0
    for c in res["capture"]:
        assert c["decode_tok_s"] > 0 and c["batch8_tok_s"] > 0 and c["same_tokens_as_eager"]
    assert f"| 128 | graphs+compile | no | {compiled['decode_tok_s']:.1f} | {compiled['batch8_tok_s']:.1f} |" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_benchmark_refuses_cuda_without_gpu(capsys):
    from benchmarks import gpu

    assert gpu.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [(["--models", "Qwen2.5-Coder-0.5B,nope"], "unknown model(s) nope"),
                                          (["--starts", "0,8K"], "--starts takes comma-separated token counts")])
def test_prefill_attention_benchmark_refuses_bad_arguments(tmp_path, capsys, args, message):
    """A misspelt model or start is a usage error naming it, before anything is measured or written."""
    from benchmarks import bench_prefill_attention

    with pytest.raises(SystemExit) as e:
        bench_prefill_attention.main(args + ["--out", str(tmp_path / "p.json")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_linear_benchmark_harness(tmp_path):
    """benchmarks/bench_linear.py on the default model, one short run: every projection has
    its 4-bit copy, every row count gets all three timings and the MLP pair."""
    from benchmarks import bench_linear

    out = tmp_path / "linear.json"
    assert bench_linear.main(["--rows", "1,9", "--runs", "1", "--dtype", "bfloat16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "210 linears (210 4-bit, as 120 matmuls)" in out.with_suffix(".md").read_text()
    lin = [r for r in res["records"] if "plain_ms" in r]
    mlp = [r for r in res["records"] if "mlp_plain_ms" in r]
    assert [r["rows"] for r in lin] == [1, 9] == [r["rows"] for r in mlp]
    assert all(r["plain_ms"] > 0 and r["packed_ms"] > 0 and r["int4_ms"] > 0 for r in lin)
    assert all(r["mlp_plain_ms"] > 0 and r["mlp_headwise_ms"] > 0 for r in mlp)


def test_prefix_bench_counts_resident_documents():
    """bench_prefix's capacity count on a tiny shape: a split layout keeps more cached
    documents in the same budget than `full`, and each one is then a hit."""
    import torch

    from benchmarks.bench_prefix import resident_documents
    from headwise.heads.layout import HeadLayout

    shape = (2, 4, 8)
    split = HeadLayout.from_full_set("s", shape, {(0, 0), (1, 0)}, sink=4, window=32)
    budget = 8_000_000
    full_n, full_per = resident_documents(HeadLayout.full(shape), budget, 3000, 2, torch.float32, num_docs=30)
    split_n, split_per = resident_documents(split, budget, 3000, 2, torch.float32, num_docs=30)
    assert 0 < full_n < split_n and split_per < full_per


def test_select_benchmark_measures_each_layout(tiny_models, tmp_path):
    from benchmarks import bench_select
    from headwise import HeadLayout
    from headwise.heads.layout import HeadSpec

    path = str(tiny_models["llama"])
    lay = HeadLayout.uniform("sel", (2, 2, 16), HeadSpec("select", 4, 8, 32))
    lay.save(tmp_path / "sel.json")
    out = tmp_path / "bench"
    assert bench_select.main(["--model", path, "--layouts", f"full,{tmp_path / 'sel.json'}", "--contexts", "64,200",
                              "--batches", "1,2", "--steps", "2", "--rounds", "1", "--kv-cache-memory", "256MiB",
                              "--out-dir", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    rows = res["rows"]
    assert res["kv_cache_memory"] == 256 << 20
    assert [(r["layout"], r["context"]) for r in rows] == [("full", 64), ("sel", 64), ("full", 200), ("sel", 200)]
    assert all(r["batch1_tok_s"] > 0 and r["batch2_tok_s"] > 0 for r in rows)
    # select heads keep every token: full's K/V bytes, plus a min/max summary per block and head
    assert rows[3]["kv_bytes_per_seq"] > rows[2]["kv_bytes_per_seq"]
    md = (out / "results.md").read_text()
    assert "| sel | 4 select of 4 KV heads | 200 |" in md and "0.25 GiB of KV per layout" in md


def test_results_name_the_cpus_avx512_and_amx_flags():
    """Every results file's machine line names the ISA flags behind the CPU speed gaps, read
    from /proc/cpuinfo's flags as whole words (avx512f is not avx512fp16)."""
    from benchmarks import common

    intel = ("processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu sse2 avx2 avx512fp16 avx512_bf16 "
             "amx_tile amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx512f amx_int8\n")
    assert common.isa_flags(intel) == ["avx2", "avx512_bf16", "amx_tile", "amx_bf16"]  # the first CPU's line
    assert common.isa_flags("processor\t: 0\nFeatures\t: fp asimd\n") == []
    assert common.isa_flags("") == []
    info = common._cpuinfo()
    if not info:
        pytest.skip("no /proc/cpuinfo")
    here = common.isa_flags(info)
    line = common.machine()
    assert all(f in line for f in here)
    assert ("no AVX2/AVX-512/AMX" in line) == (not here)
