"""Calibration (tiny random model) and the evaluation task generators and scorers."""
import json

import pytest

from headwise.heads.layout import HeadLayout
from headwise.evaluation import tasks
from headwise.evaluation.suite import equal_bytes_window


def test_calibration_is_deterministic_and_well_shaped(tiny_models, tmp_path):
    from headwise.calibration import calibrate

    kw = dict(full_fraction=0.5, sink=4, window=16, num_samples=3, lengths=(96, 128), rounds=1, method="ablation",
              progress=False)
    a = calibrate(str(tiny_models["llama"]), seed=3, **kw)
    b = calibrate(str(tiny_models["llama"]), seed=3, **kw)
    assert a.heads == b.heads and a.scores == b.scores
    assert a.shape == (2, 2, 16)
    assert len(a.scores) == 2 and all(len(r) == 2 for r in a.scores)
    assert sum(a.num_paged(l) for l in range(2)) == 2  # 50% of 4 KV heads
    assert all(s.window == 16 and s.sink == 4 for row in a.heads for s in row if s.kind == "window")
    f = tmp_path / "cal.json"
    a.save(f)
    back = HeadLayout.load(f)
    assert back.heads == a.heads and back.scores == a.scores
    assert json.loads(f.read_text())["model"] == "llama"


@pytest.mark.parametrize("method, dtype", [("gates", "auto"), ("gates", "bfloat16"), ("mass", "auto")])
def test_every_method_is_deterministic_and_keeps_the_fraction(tiny_models, method, dtype):
    from headwise.calibration import calibrate

    kw = dict(full_fraction=0.5, sink=4, window=16, num_samples=3, lengths=(96, 128), progress=False,
              method=method, steps=4, engine_options={"dtype": dtype})
    a = calibrate(str(tiny_models["qwen2"]), seed=1, **kw)
    b = calibrate(str(tiny_models["qwen2"]), seed=1, **kw)
    assert a.heads == b.heads and a.scores == b.scores
    assert sum(a.num_paged(l) for l in range(2)) == 2
    assert a.name == f"calibrated-{method}-0.5"
    flat = sorted(((x, (l, h)) for l, row in enumerate(a.scores) for h, x in enumerate(row)), reverse=True)
    assert {lh for _, lh in flat[:2]} == {(l, h) for l in range(2) for h in range(2) if a.heads[l][h].kind == "full"}


def test_calibrate_rejects_an_unknown_method(tiny_models):
    from headwise.calibration import calibrate

    with pytest.raises(ValueError, match="unknown calibration method"):
        calibrate(str(tiny_models["llama"]), method="oracle", progress=False)


def test_calibration_runs_with_an_int8_kv_cache(tiny_models):
    from headwise.calibration import calibrate

    lay = calibrate(str(tiny_models["llama"]), full_fraction=0.5, sink=4, window=16, num_samples=2,
                    lengths=(96,), rounds=1, progress=False, engine_options={"kv_cache_dtype": "int8"},
                    method="ablation")
    assert sum(lay.num_paged(l) for l in range(2)) == 2 and len(lay.scores) == 2


def test_calibrate_rejects_bad_fraction(tiny_models):
    from headwise.calibration import calibrate

    with pytest.raises(ValueError, match="full_fraction"):
        calibrate(str(tiny_models["llama"]), full_fraction=1.5, progress=False)


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from headwise.tokenizer import Tokenizer

    return Tokenizer.from_path(tokenizer_dir)


@pytest.mark.parametrize("kind", list(tasks.TASKS))
@pytest.mark.parametrize("length", [1024, 4096])
def test_generated_prompts_have_requested_length_and_depth(tok, kind, length):
    for depth in (0.0, 0.5, 1.0):
        s = tasks.TASKS[kind](tok, length, depth, seed=11)
        n = len(tok.encode(s.text))
        assert abs(n - length) <= 0.02 * length, (kind, n)
        if kind in ("passkey", "niah", "multikey"):
            at = len(tok.encode(s.text[: s.text.index(s.needles[0])]))
            assert abs(at / n - depth) <= 0.05, (kind, depth, at / n)


def test_generators_are_seeded(tok):
    assert tasks.niah(tok, 1024, 0.3, seed=5).text == tasks.niah(tok, 1024, 0.3, seed=5).text
    assert tasks.niah(tok, 1024, 0.3, seed=5).answers != tasks.niah(tok, 1024, 0.3, seed=6).answers


def test_scorers_on_hand_written_outputs(tok):
    pk = tasks.passkey(tok, 1024, 0.5, seed=1)
    assert tasks.score(pk, f" {pk.answers[0]}. Remember it.") == 1.0
    assert tasks.score(pk, " 12. a magical number") == 0.0
    vt = tasks.variable_tracking(tok, 1024, 0.2, seed=1)
    assert tasks.score(vt, " ".join(vt.answers)) == 1.0
    assert tasks.score(vt, vt.answers[0] + " and XYZ") == pytest.approx(1 / len(vt.answers))
    cw = tasks.common_words(tok, 1024, seed=1)
    assert tasks.score(cw, ", ".join(cw.answers)) == 1.0
    assert tasks.score(cw, "banana, kiwi") == 0.0


def test_common_words_really_are_most_common(tok):
    from collections import Counter

    cw = tasks.common_words(tok, 2048, seed=4)
    body = cw.text.split("\n\n")[1]
    counts = Counter(w for w in body.split() if w.isalpha())
    assert {w for w, _ in counts.most_common(3)} == set(cw.answers)


def test_equal_bytes_window_baseline_matches_kv_bytes():
    import torch

    from headwise.cache.manager import KVCacheManager
    from headwise.evaluation.suite import EVAL_ENGINE_OPTIONS

    shape = (30, 3, 64)
    split = HeadLayout.random(shape, 0.25, seed=1)
    for L in (1024, 2048, 8000):
        w = equal_bytes_window(split, L)
        a = KVCacheManager(split, 16, 1 << 30, 2, torch.float32).kv_bytes(L)
        b = KVCacheManager(w, 16, 1 << 30, 2, torch.float32).kv_bytes(L)
        assert abs(a - b) / a < 0.01
        # the baseline's rings fit the evaluation engine's budget at every length
        o = EVAL_ENGINE_OPTIONS
        KVCacheManager(w, 16, o["kv_cache_memory"], o["max_num_seqs"], torch.float32)


def test_eval_cli_runs_every_task_and_writes_outputs(tiny_models, tmp_path, capsys):
    from headwise.cli import main

    lay = tmp_path / "half.json"
    HeadLayout.from_full_set("half", (2, 2, 16), {(0, 0), (1, 1)}, sink=4, window=16).save(lay)
    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(tiny_models["llama"]), "--head-layout", str(lay), "--baselines", "--rebased",
               "--tasks", "passkey,niah,ruler,ppl,agreement", "--lengths", "160", "--json", str(out),
               "--kv-dtypes", "int8", "--plot-dir", str(tmp_path / "plots")])
    assert rc == 0
    recs = json.loads(out.read_text())
    names = ("full", "full+int8", "half", "half+int8", "half+rebased", "random-50%", "window-same-KV")
    assert {r["layout"] for r in recs} == set(names)
    assert {r["task"] for r in recs} == {"passkey", "niah", "multikey", "vartrack", "cwe", "ppl", "agreement"}
    for r in recs:
        assert set(r) >= {"layout", "task", "length", "score", "n"}
    assert all(r["score"] == 1.0 for r in recs if r["layout"] == "full" and r["task"] == "agreement")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(f"needle_{n}.png" for n in names)
    assert main(["eval", "--model", str(tiny_models["llama"]), "--kv-dtypes", "int3", "--lengths", "160"]) == 2
    assert "unknown KV cache dtype 'int3'" in capsys.readouterr().err


def test_calibrate_cli_rejects_bad_lengths(tmp_path, capsys):
    from headwise.cli import main

    rc = main(["calibrate", "--out", str(tmp_path / "l.json"), "--lengths", "1024,lots"])
    assert rc == 2
    assert "--lengths must be comma-separated integers" in capsys.readouterr().err
    assert not (tmp_path / "l.json").exists()


def test_calibrate_cli_rejects_bad_kinds(tmp_path, capsys):
    from headwise.cli import main

    rc = main(["calibrate", "--out", str(tmp_path / "l.json"), "--kinds", "number,essay"])
    assert rc == 2
    assert "calibration kinds must be some of number, phrase, distractors, tally, codes" in capsys.readouterr().err
    assert not (tmp_path / "l.json").exists()


def test_select_from_stored_scores(tmp_path, capsys):
    """`calibrate --from-scores` re-picks the top heads of a calibrated layout's stored
    scores with another fraction and window, without running a model."""
    from headwise.calibration import select_from_scores
    from headwise.cli import main

    scores = [[0.9, 0.1, 0.5], [0.2, 0.8, 0.3]]
    src = HeadLayout.from_full_set("cal", (2, 3, 8), {(0, 0)}, 4, 16, model="m", scores=scores)
    src.save(tmp_path / "cal.json")
    out = tmp_path / "sel.json"
    rc = main(["calibrate", "--from-scores", str(tmp_path / "cal.json"), "--full-fraction", "0.5",
               "--sink", "2", "--window", "32", "--name", "top3", "--out", str(out)])
    assert rc == 0 and "3 full, 3 window of 6 KV heads" in capsys.readouterr().out
    sel = HeadLayout.load(out)
    full = {(l, h) for l in range(2) for h in range(3) if sel.heads[l][h].kind == "full"}
    assert full == {(0, 0), (1, 1), (0, 2)}  # scores 0.9, 0.8, 0.5
    assert {(s.sink, s.window) for row in sel.heads for s in row if s.kind == "window"} == {(2, 32)}
    assert sel.name == "top3" and sel.model == "m" and sel.scores == scores
    with pytest.raises(ValueError, match="stores no calibration scores"):
        select_from_scores(HeadLayout.full((2, 3, 8)), 0.5)
    with pytest.raises(ValueError, match="full_fraction"):
        select_from_scores(src, 2.0)
