"""The quality suite: haystack sources, every family's prompt builder and scorer on
hand-made examples, the interval and the verdict, and that calibration data is held out
(no shared source, sentence or needle template)."""
import itertools

import pytest

from headwise.calibration import samples as calib
from headwise.evaluation import families, quality, sources, tasks


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from headwise.tokenizer import Tokenizer

    return Tokenizer.from_path(tokenizer_dir)


def test_sources_read_real_prose():
    assert set(sources.EVAL_SOURCES) == {"licenses", "pydoc", "man"}
    assert set(sources.CALIB_SOURCES) == {"info", "readme"}
    for name in sources.SOURCES:
        sents = sources.sentences(name)
        assert len(sents) >= 200
        assert all(sources.MIN_WORDS <= len(s.split()) <= sources.MAX_WORDS and s.endswith(" ") for s in sents)
    assert any("Python" in s or "object" in s for s in sources.sentences("pydoc"))
    with pytest.raises(ValueError, match="unknown haystack source"):
        sources.sentences("essays")


def test_roff_text_strips_requests_and_escapes():
    src = '.TH LS 1\n.SH NAME\nls \\- list directory contents\n.B \\-a\ndo not ignore entries starting with \\fB.\\fR\n'
    text = sources.roff_text(src)
    assert "list directory contents" in text and "\\f" not in text and ".TH" not in text and "-a" in text


def test_split_sentences_keeps_prose_only():
    got = sources.split_sentences("See https://x.org for more info here. The quick brown fox jumps over it. "
                                  "a = b + c * d / e % f; Short one.")
    assert got == ["The quick brown fox jumps over it. "]


def test_calibration_and_evaluation_are_disjoint(tok):
    # sources: different roles, and no sentence of a calibration source occurs in an eval source
    assert not set(sources.EVAL_SOURCES) & set(sources.CALIB_SOURCES)
    held_out = set().union(*(sources.sentences(n) for n in sources.EVAL_SOURCES))
    for n in sources.CALIB_SOURCES:
        assert not held_out & set(sources.sentences(n))
    # needle templates: no template, nor any needle's fixed wording, in common
    def stems(templates):
        return {t.split("{")[0].strip().lower() for t in templates if t.split("{")[0].strip()}
    assert not set(calib.CALIB_TEMPLATES) & set(families.EVAL_TEMPLATES)
    assert not stems(calib.CALIB_TEMPLATES) & stems(families.EVAL_TEMPLATES)
    # built prompts, every kind: calibration haystacks contain no eval sentence
    for s in calib.make_samples(tok, len(calib.ALL_KINDS), (512,), seed=0, kinds=calib.ALL_KINDS):
        body = s.sample.text
        assert not any(x.strip() in body for x in list(held_out)[:3000] if len(x) > 60)
        assert s.sample.needles and all(n in body for n in s.sample.needles)


def test_tally_calibration_prompt_asks_for_the_city_named_most(tok):
    import re

    for seed in (1, 2, 3):
        s = calib.calib_prompt(tok, "tally", 1024, 0.5, seed)
        assert abs(len(tok.encode(s.text)) - 1024) <= 0.02 * 1024
        body, question = s.text.rsplit("\n\n", 1)
        person = re.match(r"Which city did (\w+) take", question).group(1)
        trips = re.findall(rf"{person} took the night train to (\w+)\.", body)
        counts = sorted(((trips.count(c), c) for c in set(trips)), reverse=True)
        assert [n for n, _ in counts] == list(calib.TALLY_COUNTS)
        assert s.answers == [counts[0][1]]
        assert all(n in body for n in s.needles) and len(s.needles) == sum(calib.TALLY_COUNTS)
    # the default mix is unchanged (shipped layouts were calibrated with it) and seeded
    one = calib.make_samples(tok, 6, (512,), seed=0)
    assert [x.sample.task for x in one] == list(calib.KINDS) * 2
    assert [x.ids for x in one] == [x.ids for x in calib.make_samples(tok, 6, (512,), seed=0)]
    mixed = calib.make_samples(tok, 4, (512,), seed=0, kinds=("number", "tally"))
    assert [x.sample.task for x in mixed] == ["number", "tally"] * 2
    for bad in ((), ("tally", "poem")):
        with pytest.raises(ValueError, match="calibration kinds must be some of"):
            calib.make_samples(tok, 2, (512,), seed=0, kinds=bad)


def test_codes_calibration_prompt_asks_one_of_several_serial_codes(tok):
    import re

    shape = r"[A-Z0-9]{3}-[0-9]{4}-[A-Z]{3}"
    for seed in (1, 2):
        s = calib.calib_prompt(tok, "codes", 1024, 0.3, seed)
        body, question = s.text.rsplit("\n\n", 1)
        crates = re.findall(rf"The crate stamped ({shape}) contains spare part ({shape})\.", body)
        assert len(crates) == len(s.needles) == calib.CODE_NEEDLES
        assert len({k for k, _ in crates}) == calib.CODE_NEEDLES
        key, value = re.findall(shape, s.needles[0])  # the first needle is the one asked
        assert set(re.findall(shape, question)) == {key}
        assert s.answers == [value] == [v for k, v in crates if k == key] and body.count(value) == 1
        # a serial code is not a UUID (the suite's uuidkey family): the shapes differ
        assert not re.search(r"[0-9a-f]{8}-[0-9a-f]{4}", s.text)


@pytest.mark.parametrize("name", list(families.FAMILIES))
def test_family_prompts_have_length_depth_and_their_answer_once(tok, name):
    fam = families.FAMILIES[name]
    for depth, seed in ((0.0, 0), (0.5, 4), (1.0, 8)):
        s = fam.build(tok, 1024, depth, seed)
        n = len(tok.encode(s.text))
        assert abs(n - 1024) <= 0.02 * 1024, (name, n)
        assert s.answers and all(a for a in s.answers)
        assert s.text == fam.build(tok, 1024, depth, seed).text  # seeded
        if s.needles:
            first = s.needles[0]
            assert s.text.count(first) == 1, (name, first)
            # the depth, in tokens of the document before the question, falls on the needle
            # (uuidkey's needles and question are long), give or take 6%
            doc = len(tok.encode(s.text.rsplit("\n\n", 1)[0]))
            at = len(tok.encode(s.text[: s.text.index(first)])) / doc
            end = at + len(tok.encode(first)) / doc
            assert at - 0.06 <= depth <= end + 0.06, (name, depth, at, end)
            if name in ("number", "phrase", "multikey", "uuidkey", "passkey"):
                # the answer is in the text exactly once, inside the needle
                ans = s.answers[0] if name != "phrase" else s.answers[-1]
                assert s.text.lower().count(ans.lower()) == 1 + (name == "passkey"), (name, ans)
        # the scorer accepts the expected strings and rejects an unrelated answer
        assert tasks.score(s, " " + " ".join(s.answers) + ".") == 1.0
        assert tasks.score(s, " I do not know.") == 0.0


def test_seeds_cover_every_phrasing_and_source(tok):
    seen = {(seed % 3, families._source(seed)) for seed in range(15)}
    assert len(seen) == 9
    texts = {families.number(tok, 512, 0.5, seed).text.split("\n\n")[-1] for seed in range(3)}
    assert len(texts) == 3  # three phrasings of the question


def test_phrase_scorer_needs_the_copied_words(tok):
    s = families.phrase(tok, 512, 0.5, seed=0)
    assert s.answers == families.content_words(s.needles[0].split(" is to ")[-1])
    full = " " + s.needles[0].split(" is to ")[-1]
    assert tasks.score(s, full) == 1.0
    half = " ".join(full.split()[:2])
    assert 0 < tasks.score(s, half) < 1


def test_qa_answer_is_a_span_of_the_document(tok):
    s = families.qa(tok, 1024, 0.25, seed=1)
    opening = s.text.split('begins with "')[1].split('"')[0]
    sentence = next(x for x in s.needles)
    assert sentence.strip().startswith(opening)
    rest = sentence.strip()[len(opening):]
    assert tasks.score(s, rest) == 1.0
    assert s.text.count(opening) == 2  # in the document once, and quoted by the question


def test_uuidkey_asks_one_of_many_random_keys_and_wants_its_value_exactly(tok):
    import re

    shape = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    for length, seed in ((1024, 0), (4096, 4), (8000, 8)):
        s = families.uuidkey(tok, length, 0.5, seed)
        assert len(s.needles) == max(4, length // 512)
        pairs = [re.findall(shape, n) for n in s.needles]
        assert all(len(p) == 2 for p in pairs)
        keys = [k for k, _ in pairs]
        assert len(set(keys)) == len(keys)
        body, question = s.text.rsplit("\n\n", 1)
        asked = re.findall(shape, question)
        assert set(asked) == {pairs[0][0]} and s.answers == [pairs[0][1]]
        assert body.count(asked[0]) == 1 and body.count(s.answers[0]) == 1
        # another needle's value, or the value with one character changed, scores 0
        assert tasks.score(s, " " + pairs[1][1] + ".") == 0.0
        wrong = s.answers[0][:-1] + ("0" if s.answers[0][-1] != "0" else "1")
        assert tasks.score(s, " " + wrong) == 0.0
        assert tasks.score(s, " " + s.answers[0].upper() + ".") == 1.0


def test_fwe_answers_are_the_most_frequent_words(tok):
    s = families.fwe(tok, 1024, 0.0, seed=2)
    body = s.text.split("\n\n")[1].split()
    counts = {w: body.count(w) for w in set(body)}
    top = sorted(counts, key=counts.get, reverse=True)[:3]
    assert set(top) == set(s.answers)


def test_wilson_interval():
    lo, hi = quality.wilson(1.0, 15)
    assert hi == 1.0 and 0.78 < lo < 0.80
    lo, hi = quality.wilson(0.5, 100)
    assert lo == pytest.approx(0.404, abs=2e-3) and hi == pytest.approx(0.596, abs=2e-3)
    assert quality.wilson(0.0, 10)[0] == 0.0


def _records(layout, scores, family="number", length=1024):
    return [quality.SuiteRecord(layout, family, length, d, i, s)
            for (d, i), s in zip([(d, i) for d in quality.DEPTHS for i in range(3)], scores)]


def test_verdict_equal_and_not_equal():
    ref = _records("full", [1.0] * 15)
    same = _records("a", [1.0] * 15)
    worse = _records("b", [1.0] * 11 + [0.0] * 4)       # 73%: below full's interval (78%-100%)
    v = quality.compare(ref + same, "full", "a")
    assert v.equal and v.lost == 0 and v.ref_passed == 15
    v = quality.compare(ref + worse, "full", "b")
    assert not v.equal and not v.cells[0].equal and v.lost == 4
    assert v.lost_prompts == [("number", 1024, 0.75, 2)] + [("number", 1024, 1.0, i) for i in range(3)]
    # inside every cell's interval, but losing more than 2% of the prompts full passes
    many = [r for L in (1024, 2048, 4096) for f in ("number", "phrase") for r in _records("full", [1.0] * 15, f, L)]
    one_each = [r for L in (1024, 2048, 4096) for f in ("number", "phrase")
                for r in _records("c", [0.0] + [1.0] * 14, f, L)]
    v = quality.compare(many + one_each, "full", "c")
    assert all(c.equal for c in v.cells) and v.lost == 6 and not v.equal
    text = quality.report(ref + same + worse, "full")
    assert "below" in text and "NOT equal" in text and "EQUAL to full" in text
    assert "lost: number@1024 depth 75% seed 2, number@1024 depth 100% seed 0," in text
    # perplexity: a figure only where both were measured on the same source and length
    assert text.count("perplexity not compared") == 2
    ppl = [quality.SuiteRecord(name, "ppl:pydoc", 1024, None, 0, x) for name, x in (("full", 10.0), ("a", 10.5))]
    text = quality.report(ref + same + ppl + [quality.SuiteRecord("b", "ppl:man", 1024, None, 0, 9.0)] + worse,
                          "full")
    assert "- a: EQUAL to full;" in text and "perplexity at most +5.0% over full's" in text
    assert "- b: NOT equal" in text and text.count("perplexity not compared") == 1


def test_suite_records_round_trip(tmp_path):
    recs = _records("full", [1.0, 0.5] + [0.0] * 13)
    quality.save(recs, tmp_path / "r.json")
    assert quality.load(tmp_path / "r.json") == recs


def test_eval_suite_cli_runs_and_reports(tiny_models, tmp_path):
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "headwise.cli", "eval", "--model", str(tiny_models["llama"]),
                               *args], capture_output=True, text=True, timeout=600)

    out = tmp_path / "suite.json"
    r = run("--suite", "--head-layout", "window", "--families", "number,qa", "--lengths", "160", "--seeds", "1",
            "--kv-cache-memory", "64MiB", "--json", str(out), "--plot-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    recs = quality.load(out)
    assert {x.layout for x in recs} == {"full", "window"}
    assert sum(x.family == "number" for x in recs) == 2 * len(quality.DEPTHS)
    assert {x.family for x in recs if x.family.startswith("ppl:")} == {f"ppl:{s}" for s in sources.EVAL_SOURCES}
    assert "| number | 160 |" in r.stdout and "window:" in r.stdout
    assert (tmp_path / "quality_fractions.png").is_file()
    # the stored records alone make the same table, and nothing is run again
    again = run("--report", str(out), "--families", "number,qa", "--lengths", "160")
    assert again.returncode == 0, again.stderr
    assert again.stdout.split("\n- ")[0] == r.stdout.split("\n- ")[0]
    # a layout run alone merges with the reference's records afterwards
    alone = tmp_path / "alone.json"
    r = run("--suite", "--no-reference", "--head-layout", "window", "--families", "number", "--lengths", "160",
            "--seeds", "1", "--kv-cache-memory", "64MiB", "--json", str(alone))
    assert r.returncode == 0 and "no reference records" in r.stdout, r.stderr
    assert {x.layout for x in quality.load(alone)} == {"window"}
    # the reference itself can be run alone too (its records merge with the layouts' later)
    ref_alone = tmp_path / "ref.json"
    r = run("--suite", "--no-reference", "--head-layout", "full", "--families", "number", "--lengths", "160",
            "--seeds", "1", "--kv-cache-memory", "64MiB", "--json", str(ref_alone))
    assert r.returncode == 0, r.stderr
    assert {x.layout for x in quality.load(ref_alone)} == {"full"}


def test_eval_suite_cli_refuses_bad_input(tiny_models, capsys, monkeypatch):
    from headwise import cli

    monkeypatch.setattr(cli, "show_engine_logs", lambda: None)  # keep pytest's logging as it is
    model = ["eval", "--model", str(tiny_models["llama"])]
    assert cli.main([*model, "--suite", "--no-reference", "--families", "number", "--lengths", "160"]) != 0
    assert "nothing to run" in capsys.readouterr().err
    assert cli.main([*model, "--suite", "--families", "number,essays"]) != 0
    assert "unknown suite family 'essays'" in capsys.readouterr().err


def test_suite_run_resumes_by_prompt(tiny_models, tmp_path, monkeypatch):
    # A run stopped after its first family: given its own records back, the next run
    # computes only what is missing and keeps what was there.
    from headwise.evaluation.suite import run_quality

    model = str(tiny_models["llama"])
    opts = dict(kv_cache_memory=64 << 20, max_num_batched_tokens=8192, max_num_seqs=2)
    saved, save = [], quality.save
    monkeypatch.setattr(quality, "save", lambda records, path: (saved.append(len(records)), save(records, path)))
    first, _ = run_quality(model, ["window"], ["number", "qa"], [160], seeds=1, json_path=tmp_path / "a.json",
                           engine_options=opts, reference=False)
    # written after every prompt and perplexity, so a run stopped mid-family loses one prompt at most
    assert saved == list(range(1, len(first) + 1))
    assert quality.load(tmp_path / "a.json") == first
    monkeypatch.setattr(quality, "save", save)
    stopped = [r for r in first if r.family == "number"]
    for r in stopped:
        r.output = "kept"  # a mark that recomputing would overwrite
    again, _ = run_quality(model, ["window"], ["number", "qa"], [160], seeds=1, json_path=tmp_path / "b.json",
                           engine_options=opts, previous=stopped, reference=False)
    assert [r.output for r in again if r.family == "number"] == ["kept"] * len(quality.DEPTHS)
    key = lambda r: (r.family, r.depth, r.seed)  # noqa: E731
    assert sorted(map(key, again)) == sorted(map(key, first))
    assert quality.load(tmp_path / "b.json") == again
    # more seeds later: only the prompts of the new seeds run; the first seed's are kept
    more, _ = run_quality(model, ["window"], ["number"], [160], seeds=2, engine_options=opts, previous=again,
                          reference=False)
    number = [r for r in more if r.family == "number"]
    assert sorted((r.depth, r.seed) for r in number) == sorted(
        (depth, quality.seed_of(d, i)) for d, depth in enumerate(quality.DEPTHS) for i in range(2))
    assert sum(r.output == "kept" for r in number) == len(quality.DEPTHS)
    assert sum(r.family.startswith("ppl:") for r in more) == sum(r.family.startswith("ppl:") for r in again)


def test_layouts_take_turns_family_by_family_with_one_engine_each(tiny_models, monkeypatch):
    # A run stopped part-way must leave every layout's answers to the same prompts: the
    # reference and the layout alternate per family, each engine built once.
    from headwise.evaluation import suite

    model = str(tiny_models["llama"])
    opts = dict(kv_cache_memory=64 << 20, max_num_batched_tokens=8192, max_num_seqs=2)
    built, make = [], suite.LLM
    monkeypatch.setattr(suite, "LLM", lambda *a, **kw: (built.append(kw["head_layout"]), make(*a, **kw))[1])
    records, _ = suite.run_quality(model, ["window"], ["qa", "number"], [160, 192], seeds=1, engine_options=opts)
    assert len(built) == 2
    runs = [(r.length, r.family if r.depth is not None else "ppl", r.layout) for r in records]
    turns = [k for k, _ in itertools.groupby(runs)]
    assert len(turns) == len(set(runs))  # each (length, family, layout) is one contiguous run
    # by length, then in the suite's family order (not the order asked), perplexity last;
    # within each, the reference and then the layout
    fams = [f for f in quality.FAMILIES if f in ("qa", "number")] + ["ppl"]
    assert turns == [(L, f, lay) for L in (160, 192) for f in fams for lay in ("full", "window")]


def test_a_named_dtype_tags_its_records_and_is_reported_beside_the_engine_dtype(tiny_models):
    # Records of another compute dtype are not "done" for the engine's own (nor the
    # reverse): they run under their own names, and the report sets both side by side.
    from headwise.evaluation.suite import run_quality

    model = str(tiny_models["llama"])
    opts = dict(kv_cache_memory=64 << 20, max_num_batched_tokens=8192, max_num_seqs=2)
    auto, text = run_quality(model, ["window"], ["number"], [160], seeds=1, engine_options=opts)
    assert set(quality.layouts_of(auto)) == {"full", "window"} and text is not None
    f32, text = run_quality(model, ["window"], ["number"], [160], seeds=1, previous=auto,
                            engine_options={**opts, "dtype": "float32"})
    new = [r for r in f32 if r.layout.endswith("@float32")]
    assert {r.layout for r in new} == {"full@float32", "window@float32"}
    assert len(new) == len(auto)  # every prompt and perplexity ran again, in float32
    assert "| full@float32 (95% interval) |" in text.splitlines()[0]  # its own reference
    _, both = run_quality(model, [], ["number"], [160], seeds=1, previous=f32, reference=False)
    assert both is not None and "full@float32: " in both and "window@float32: " in both  # beside full


def test_overlapping_reports_count_each_prompt_once(tmp_path):
    # Two runs resumed from the same one-seed record, side by side: both files hold it.
    rec = lambda layout, seed, score: quality.SuiteRecord(layout, "number", 160, 0.5, seed, score, "x")  # noqa: E731
    one_seed = [rec("full", 1, 1.0), rec("window", 1, 0.0)]
    quality.save(one_seed + [rec("full", 4, 1.0)], tmp_path / "full.json")
    quality.save(one_seed + [rec("window", 4, 1.0)], tmp_path / "window.json")
    merged = quality.load(tmp_path / "full.json", tmp_path / "window.json")
    assert sorted((r.layout, r.seed) for r in merged) == [("full", 1), ("full", 4), ("window", 1), ("window", 4)]
    quality.save([rec("window", 1, 1.0)], tmp_path / "other.json")
    with pytest.raises(ValueError, match=r"hold different results for layout 'window', number .* seed 1"):
        quality.load(tmp_path / "window.json", tmp_path / "other.json")


def test_method_of_drops_fraction_and_window():
    assert quality.method_of("smollm2-gates-33-w512") == "smollm2-gates"
    assert quality.method_of("smollm2-gates") == "smollm2-gates"
    assert quality.method_of("smollm2-calibrated-22-w512") == "smollm2-calibrated"
    assert quality.method_of("mass-0.25") == "mass"
    assert quality.method_of("window") == "window"


def test_suite_runs_layout_objects_beside_the_reference(tiny_models):
    # `make quality` passes the shipped layout as a HeadLayout, not a name
    from headwise.heads.layout import HeadLayout
    from headwise.evaluation.suite import run_quality

    model = str(tiny_models["llama"])
    lay = HeadLayout.window((2, 2, 16), sink=4, window=16)
    lay.name = "tiny-window"
    recs, text = run_quality(model, [lay], ["number"], [160], seeds=1,
                             engine_options=dict(kv_cache_memory=64 << 20, max_num_batched_tokens=8192, max_num_seqs=2))
    assert quality.layouts_of(recs) == ["full", "tiny-window"]
    assert "tiny-window: " in text
