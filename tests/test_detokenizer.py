"""Incremental detokenization: the text equals a whole decode, stop strings are found
across token boundaries, and the work per token stays bounded as the output grows."""
import pytest
from transformers import AutoTokenizer

from headwise.engine.detokenizer import IncrementalDetokenizer
from headwise.tokenizer import Tokenizer

# Multi-byte characters split over several byte-level tokens, spaces, newlines, digits.
TEXT = "Ünïcödé façade, 東京 and 🚀🌍 rockets; naïve café ☕ at 12:30.\n  Indented line. "


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return Tokenizer(AutoTokenizer.from_pretrained(str(tokenizer_dir)))


def _feed(tok, ids, stop=(), **kw):
    d = IncrementalDetokenizer(tok, list(stop), **kw)
    out, per_step = [], []
    for i in range(1, len(ids) + 1):
        before = (d.tokens_decoded, d.chars_scanned)
        hit = d.step(ids[:i])
        per_step.append((d.tokens_decoded - before[0], d.chars_scanned - before[1]))
        out.append(d.text)
        if hit:
            return d, out, per_step, True
    d.flush(ids)
    return d, out, per_step, False


def test_text_equals_whole_decode_and_never_shows_half_characters(tok):
    ids = tok.encode(TEXT * 3, add_special_tokens=False)
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(len(ids)))  # splits exist
    d, texts, _, hit = _feed(tok, ids)
    assert not hit and d.text == tok.decode(ids)
    assert all("\ufffd" not in t for t in texts)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # text only grows


def test_stop_string_across_token_boundaries(tok):
    ids = tok.encode("The answer is 42. STOP-HERE and more text after it.", add_special_tokens=False)
    d, _, _, hit = _feed(tok, ids, stop=["never", "-HERE and"])
    assert hit and d.text == "The answer is 42. STOP"
    # a stop string that starts inside an earlier step's text and ends in a later one
    ids = tok.encode("abc🚀def", add_special_tokens=False)
    d, _, _, hit = _feed(tok, ids, stop=["c🚀d"])
    assert hit and d.text == "ab"


def test_include_stop_keeps_the_first_match_and_no_more(tok):
    ids = tok.encode("The answer is 42. STOP-HERE and more text after it.", add_special_tokens=False)
    d, _, _, hit = _feed(tok, ids, stop=["never", "-HERE and"], include_stop=True)
    assert hit and d.text == "The answer is 42. STOP-HERE and"
    # the match that completes first wins, as the text streams
    d, _, _, hit = _feed(tok, ids, stop=["STOP-HERE", "STOP"], include_stop=True)
    assert hit and d.text == "The answer is 42. STOP"
    ids = tok.encode("abc🚀def", add_special_tokens=False)
    d, _, _, hit = _feed(tok, ids, stop=["c🚀d", "🚀"], include_stop=True)
    assert hit and d.text == "abc🚀"
    # both complete in one step: the one that starts first
    d = IncrementalDetokenizer(tok, ["b", "ab"], include_stop=True)
    assert d._append("xxabyy") and d.text == "xxab"


def test_special_tokens_are_kept_when_asked(tok):
    special = tok.hf.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hello", add_special_tokens=False) + [special] + tok.encode(" world", add_special_tokens=False)
    assert _feed(tok, ids)[0].text == "Hello world"
    assert _feed(tok, ids, skip_special_tokens=False)[0].text == "Hello<|im_end|> world"


def test_work_per_token_is_bounded_over_4096_tokens(tok):
    ids = []
    while len(ids) < 4096:
        ids += tok.encode(TEXT, add_special_tokens=False)
    ids = ids[:4096]
    stop = ["<never appears>", "zz-end"]
    d, _, per_step, hit = _feed(tok, ids, stop=stop)
    assert not hit and d.text == tok.decode(ids)
    decoded = [a for a, _ in per_step]
    scanned = [b for _, b in per_step]
    # Each step decodes a short tail (two windows of a few tokens), never the whole output:
    # the bound does not grow with the output, so the total is linear.
    assert max(decoded) <= 16, max(decoded)
    assert max(decoded[-100:]) <= max(decoded[:100]) + 8
    assert sum(decoded) <= 8 * len(ids)
    # Stop strings are searched only where a match can end in new text.
    assert max(scanned) <= len(stop) * (max(map(len, stop)) + 32)
    assert sum(scanned) <= 64 * len(ids)
