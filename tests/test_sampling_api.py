"""The sampling API beyond temperature / top-k / top-p: logit_bias, presence, frequency and
repetition penalties, min_p, min_tokens, n choices, and structured outputs (JSON schema,
JSON object, regex, choice, grammar) through llguidance. Processors are checked against
references recomputed here; constrained outputs are parsed and validated."""
import json
import math
import re

import jsonschema
import pytest
import torch

from headwise.engine.grammar import GrammarCompiler
from headwise.engine.sampler import _process, bad_word_ids, sample
from headwise.engine.sequence import Sequence
from headwise.errors import InvalidParameterError
from headwise.sampling import SamplingParams
from headwise.structured import StructuredOutputs
from headwise.tokenizer import ChatOptions

V = 64


def _seq(out=(), prompt=(1, 2), **params) -> Sequence:
    s = Sequence(list(prompt), SamplingParams(**params))
    s.output_token_ids = list(out)
    return s


# ---- validation -----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 5e-209}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {3: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"), ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"n": 0}, "n"), ({"n": True}, "n"), ({"structured_outputs": {"json": {}}}, "structured_outputs"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"), ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": True}, "prompt_logprobs"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 129}, "best_of"), ({"best_of": 2, "temperature": 0.0}, "best_of"),
])
def test_bad_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"json": {"type": "foo"}}, "Invalid type"), ({"json": "{not json"}, "not JSON"),
    ({"regex": "(("}, "unclosed group"), ({"choice": [""]}, "non-empty"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "Unsatisfiable"),
])
def test_bad_constraints_are_refused_with_the_reason(kwargs, words):
    with pytest.raises(InvalidParameterError) as e:
        StructuredOutputs(**kwargs, param="response_format")
    assert e.value.param == "response_format" and words in str(e.value), str(e.value)


def test_choices_get_their_own_seeds():
    p = SamplingParams(n=3, seed=7, temperature=1.0)
    assert [p.for_choice(i).seed for i in range(3)] == [7, 8, 9]
    assert all(p.for_choice(i).n == 1 for i in range(3))
    assert SamplingParams(n=2).for_choice(1).seed is None
    assert SamplingParams(n=2, seed=(1 << 64) - 1).for_choice(1).seed == 0


# ---- logits processors against references ------------------------------------------------
def test_penalties_match_vllm_semantics():
    torch.manual_seed(0)
    logits = torch.randn(1, V) * 3
    s = _seq(out=[5, 5, 9], prompt=[9, 11, 12], presence_penalty=0.7, frequency_penalty=0.4,
             repetition_penalty=1.3)
    got = _process(logits.clone(), [s], set(), None)[0]
    want = logits[0].clone()
    for t in {5, 9, 11, 12}:  # in the prompt or the output: repetition
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    want[5] -= 0.4 * 2 + 0.7  # generated twice
    want[9] -= 0.4 * 1 + 0.7  # generated once (also in the prompt)
    torch.testing.assert_close(got, want)


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(2, V)
    logits[:, 2] = 5.0  # EOS would win
    a = _seq(out=[], min_tokens=2, stop_token_ids=[7], logit_bias={7: 50.0, 3: 1.0})
    b = _seq(out=[4, 4], min_tokens=2, stop_token_ids=[7])
    got = _process(logits.clone(), [a, b], {2}, None)
    assert got[0, 2] == float("-inf") and got[0, 7] == float("-inf")  # masked before min_tokens
    assert got[0, 3] == 1.0
    assert got[1, 2] == 5.0  # min_tokens reached: untouched
    ignore = _seq(out=[], min_tokens=2, ignore_eos=True)
    assert _process(logits[:1].clone(), [ignore], {2}, None)[0, 2] == 5.0
    r = sample(logits[:1].clone(), [_seq(logit_bias={40: 100.0})], {2})
    assert r[0].token == 40


def test_allowed_token_ids_mask_everything_else():
    logits = torch.randn(2, V)
    a, b = _seq(allowed_token_ids=[5, 9, 9], logit_bias={9: 2.0, 11: 3.0}), _seq()
    got = _process(logits.clone(), [a, b], {2}, None)
    want = torch.full((V,), float("-inf"))
    want[5], want[9] = logits[0, 5], logits[0, 9] + 2.0  # the bias applies after the mask
    want[11] = float("-inf") + 3.0
    torch.testing.assert_close(got[0], want)
    torch.testing.assert_close(got[1], logits[1])  # its neighbour in the batch is untouched
    picks = {sample(logits[:1].clone(), [_seq(temperature=1.0, seed=s, allowed_token_ids=[5, 9])])[0].token
             for s in range(30)}
    assert picks <= {5, 9} and len(picks) == 2


def test_bad_words_ban_the_last_token_after_the_rest():
    logits = torch.zeros(3, V)
    words = [[7], [3, 4, 5]]
    seqs = [_seq(out=[1, 3, 4]), _seq(out=[3, 9]), _seq(out=[4])]
    for s in seqs:
        s.bad_word_ids = words
    got = _process(logits.clone(), seqs, {2}, None)
    assert torch.isinf(got[:, 7]).all()               # a one-token word: always
    assert got[0, 5] == float("-inf")                 # the output ends with 3, 4
    assert got[1, 5] == 0 and got[2, 5] == 0          # it does not


def test_bad_word_ids_at_a_word_start_and_after_a_space(default_tokenizer):
    tok = default_tokenizer
    ids = bad_word_ids(tok, ["Paris", " Paris"])
    bare, spaced = tok.encode("Paris", add_special_tokens=False), tok.encode(" Paris", add_special_tokens=False)
    assert ids == [bare, spaced, bare, spaced]
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(bad_words=["ok", "  "])
    assert e.value.param == "bad_words"


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.full((1, V), -10.0)
    logits[0, 10], logits[0, 11], logits[0, 12] = 5.0, 4.5, 1.0  # p12 / p10 ~ 0.018
    picks = set()
    for seed in range(40):
        s = _seq(temperature=1.0, min_p=0.1, seed=seed)
        picks.add(sample(logits.clone(), [s])[0].token)
    assert picks == {10, 11}


def test_raw_logprobs_are_reported_before_processing():
    logits = torch.randn(1, V)
    s = _seq(logprobs=0, logit_bias={1: 100.0})
    r = sample(logits.clone(), [s])[0]
    assert r.token == 1
    assert r.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))


@pytest.fixture(scope="module")
def default_tokenizer():
    from headwise.weights.loader import load_tokenizer

    return load_tokenizer(None)


def test_grammar_mask_allows_exactly_what_the_grammar_takes(default_tokenizer):
    tok = default_tokenizer
    vocab = len(tok.hf)
    g = GrammarCompiler(tok, vocab)
    m = g.matcher(StructuredOutputs(regex="[0-9]{2,4}"))
    logits = torch.zeros(2, vocab)
    g.mask(logits, [1], [m])
    assert torch.all(logits[0] == 0)  # the unconstrained row is untouched
    allowed = (logits[1] == 0).nonzero()[:, 0].tolist()
    texts = [tok.decode([t]) for t in allowed]
    assert allowed and all(re.fullmatch("[0-9]{1,4}", t) for t in texts), texts[:20]
    # every single- and two-digit token is allowed at the start
    for t in range(vocab):
        if re.fullmatch("[0-9]{1,2}", tok.decode([t])) and tok.encode(tok.decode([t]), False) == [t]:
            assert logits[1, t] == 0, tok.decode([t])
    # compiled once per distinct constraint
    g.matcher(StructuredOutputs(regex="[0-9]{2,4}"))
    assert g.compiled == 1


# ---- end to end on the default model --------------------------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer",
     "minimum": 0, "maximum": 150}, "city": {"enum": ["Paris", "London", "Rome"]}},
     "required": ["name", "age", "city"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
     "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                  "qty": {"type": "integer", "minimum": 1}},
               "required": ["sku", "qty"], "additionalProperties": False}},
     "paid": {"type": "boolean"}}, "required": ["items", "paid"], "additionalProperties": False},
]
CHAT = [{"role": "user", "content": "Alice is 31 and lives in Paris. She ordered two ABC-12 and paid. "
                                    "Answer in JSON."}]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "order"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(default_llm, schema, temperature):
    p = SamplingParams(max_tokens=120, temperature=temperature, seed=3, n=2,
                       structured_outputs=StructuredOutputs(json=schema))
    out = default_llm.chat(CHAT, p)[0]
    for o in out.outputs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)


def test_regex_choice_grammar_and_json_object(default_llm):
    cases = [
        (StructuredOutputs(regex=r"[A-Z][a-z]+, [0-9]{2}"), lambda t: re.fullmatch(r"[A-Z][a-z]+, [0-9]{2}", t)),
        (StructuredOutputs(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (StructuredOutputs(grammar='start: "The city is " CITY "."\nCITY: "Paris" | "Rome"'),
         lambda t: t in ("The city is Paris.", "The city is Rome.")),
        (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    # A JSON object with no schema is left to the model to close; asked plainly, it does.
    chats = [CHAT] * (len(cases) - 1) + [[{"role": "user", "content": "Reply with a JSON object with one "
                                           'key "city" for: Alice lives in Paris.'}]]
    outs = default_llm.chat(chats, [SamplingParams(max_tokens=60, structured_outputs=s)
                                    for s, _ in cases], use_tqdm=False)
    for (spec, ok), o in zip(cases, outs):
        assert o.finish_reason == "stop" and ok(o.text), (spec.kind, o.text)


def test_a_constraint_does_not_leak_into_its_batch(default_llm):
    free = SamplingParams(max_tokens=24)
    alone = default_llm.chat(CHAT, free)[0].text
    both = default_llm.chat([CHAT, CHAT], [SamplingParams(max_tokens=24, structured_outputs=StructuredOutputs(
        regex="[0-9]+")), free], use_tqdm=False)
    assert re.fullmatch("[0-9]+", both[0].text) and both[1].text == alone


def test_n_choices_share_the_prompt_and_match_single_requests(default_llm):
    prompt = "Once upon a time in a small village by the sea, there lived an old fisherman who " * 4
    out = default_llm.generate(prompt, SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=11))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # choices after the first reuse the prompt's full blocks from the prefix cache
    full_blocks = len(out.prompt_token_ids) // default_llm.engine.config.block_size * \
        default_llm.engine.config.block_size
    assert all(o.num_cached_tokens >= full_blocks > 0 for o in out.outputs[1:])
    for i, o in enumerate(out.outputs):
        single = default_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=11 + i))[0]
        assert single.token_ids == o.token_ids


def test_best_of_returns_the_choices_with_the_highest_cumulative_logprob(default_llm):
    prompt = "The old lighthouse keeper climbed the stairs every evening, and"
    kw = dict(max_tokens=10, temperature=1.2, seed=5)
    every = default_llm.generate(prompt, SamplingParams(n=5, logprobs=0, **kw))[0].outputs
    sums = [math.fsum(o.logprobs) for o in every]
    assert [o.cumulative_logprob for o in every] == sums
    want = sorted(range(5), key=lambda i: -sums[i])[:2]
    assert want != [0, 1] and len({sums[i] for i in want}) == 2  # a real ranking, not the first n
    best = default_llm.generate(prompt, SamplingParams(n=2, best_of=5, **kw))[0]
    assert [o.token_ids for o in best.outputs] == [every[i].token_ids for i in want]
    assert [o.index for o in best.outputs] == [0, 1] and best.token_ids == best.outputs[0].token_ids
    # ranked on logprobs computed for the purpose, not shown where not asked for
    assert all(o.logprobs is None and o.cumulative_logprob == sums[i] for o, i in zip(best.outputs, want))
    # best_of = n returns every choice in order
    same = default_llm.generate(prompt, SamplingParams(n=5, best_of=5, **kw))[0].outputs
    assert [o.token_ids for o in same] == [o.token_ids for o in every]


def test_min_tokens_and_logit_bias_end_to_end(default_llm):
    short = default_llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=40))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 40
    longer = default_llm.chat([{"role": "user", "content": "Say hi."}],
                              SamplingParams(max_tokens=len(short.token_ids) + 6,
                                             min_tokens=len(short.token_ids) + 6))[0]
    assert len(longer.token_ids) == len(short.token_ids) + 6 and longer.finish_reason == "length"
    first = short.token_ids[0]
    banned = default_llm.chat([{"role": "user", "content": "Say hi."}],
                              SamplingParams(max_tokens=4, logit_bias={first: -100.0}))[0]
    assert banned.token_ids[0] != first


def test_allowed_ids_stop_strings_and_special_tokens_end_to_end(default_llm):
    digits = [default_llm.tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
    out = default_llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=6, temperature=1.0, seed=4,
                                                                 allowed_token_ids=digits))[0]
    assert set(out.token_ids) <= set(digits) and out.text.isdigit()
    say = [{"role": "user", "content": "Say hi."}]
    plain = default_llm.chat(say, SamplingParams(max_tokens=40))[0]
    assert plain.finish_reason == "stop" and "<|im_end|>" not in plain.text
    kept = default_llm.chat(say, SamplingParams(max_tokens=40, skip_special_tokens=False,
                                                include_stop_str_in_output=True))[0]
    assert kept.text == plain.text + "<|im_end|>"  # the stop token's text, asked for
    unkept = default_llm.chat(say, SamplingParams(max_tokens=40, skip_special_tokens=False))[0]
    assert unkept.text == plain.text
    word = plain.text.split()[1]
    cut = default_llm.chat(say, SamplingParams(max_tokens=40, stop=[word]))[0]
    with_stop = default_llm.chat(say, SamplingParams(max_tokens=40, stop=[word], include_stop_str_in_output=True))[0]
    assert with_stop.text == cut.text + word and plain.text.startswith(with_stop.text)
    with pytest.raises(InvalidParameterError) as e:  # nothing could be sampled before min_tokens
        default_llm.generate("hi", SamplingParams(allowed_token_ids=sorted(default_llm.engine.eos_ids), min_tokens=1))
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(InvalidParameterError) as e:
        default_llm.generate("hi", SamplingParams(allowed_token_ids=[10 ** 6]))
    assert e.value.param == "allowed_token_ids"


def test_chat_continues_the_final_message(default_llm):
    conv = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite fruit is"}]
    tok = default_llm.tokenizer
    opened = tok.apply_chat_template(conv, ChatOptions(add_generation_prompt=False, continue_final_message=True))
    assert opened.endswith("My favourite fruit is")  # left open, no end of turn after it
    closed = tok.apply_chat_template(conv)
    assert closed.startswith(opened) and len(closed) > len(opened)
    out = default_llm.chat(conv, SamplingParams(max_tokens=5), add_generation_prompt=False,
                           continue_final_message=True)[0]
    want = default_llm.generate([tok.encode(opened, add_special_tokens=False)], SamplingParams(max_tokens=5))[0]
    assert out.token_ids == want.token_ids
    with pytest.raises(InvalidParameterError) as e:
        default_llm.chat(conv, continue_final_message=True)
    assert e.value.param == "continue_final_message"
    with pytest.raises(InvalidParameterError) as e:
        default_llm.chat(conv, chat_template_kwargs={"messages": []})
    assert e.value.param == "chat_template_kwargs"


def test_bad_words_end_to_end(default_llm):
    prompt = "The capital of France is"
    plain = default_llm.generate(prompt, SamplingParams(max_tokens=6))[0]
    assert "Paris" in plain.text
    banned = default_llm.generate(prompt, SamplingParams(max_tokens=6, bad_words=["Paris"]))[0]
    assert "Paris" not in banned.text and banned.text != plain.text


def test_prompt_logprobs_of_choice_0_only(default_llm):
    ids = default_llm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome. " * 3)
    out = default_llm.generate([ids], SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=1, prompt_logprobs=1))[0]
    want = default_llm.engine.prompt_logprobs(ids)
    got = torch.tensor([out.prompt_logprobs[p][ids[p]] for p in range(1, len(ids))])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert out.outputs[1].num_cached_tokens > 0  # the other choices used its prompt's blocks
    assert SamplingParams(prompt_logprobs=2).for_choice(1).prompt_logprobs is None


def test_engine_refuses_out_of_vocabulary_bias(default_llm):
    with pytest.raises(InvalidParameterError) as e:
        default_llm.generate("hi", SamplingParams(logit_bias={10 ** 6: 1.0}))
    assert e.value.param == "logit_bias"
    assert not default_llm.engine.has_unfinished()


def test_fuzzed_constraints_compile_or_are_refused(default_tokenizer):
    """Arbitrary JSON as a schema, arbitrary text as a regex or grammar: each compiles and
    masks, or is refused with InvalidParameterError; nothing else escapes."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    g = GrammarCompiler(default_tokenizer, len(default_tokenizer.hf))
    leaf = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6) | st.sampled_from(
        ["object", "string", "integer", "array", "#", "#/defs/x", "^a+$"])
    values = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(
        ["type", "properties", "items", "required", "enum", "$ref", "anyOf", "pattern", "minItems", "x"]), c,
        max_size=4), max_leaves=12)
    spec = st.one_of(values.map(lambda v: {"json": v}), st.text(max_size=12).map(lambda t: {"regex": t}),
                     st.text(max_size=16).map(lambda t: {"grammar": t}),
                     st.lists(st.text(max_size=4), max_size=3).map(lambda c: {"choice": c}))

    @given(spec)
    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(kw):
        try:
            s = StructuredOutputs(**kw)
        except InvalidParameterError:
            return
        logits = torch.zeros(1, len(default_tokenizer.hf))
        try:
            m = g.matcher(s)
        except InvalidParameterError:
            return
        g.mask(logits, [0], [m])
        assert torch.isfinite(logits).any()  # something is always allowed (at least the end)

    check()


class _FailedMatcher:
    """A matcher that hit one of llguidance's limits (they need grammars too large to
    build in a test): it reports an error and accepts nothing."""

    def is_error(self):
        return True

    def get_error(self):
        return "too many expressions constructed"

    def is_accepting(self):
        return False


def test_a_grammar_failing_mid_way_ends_only_its_own_sequence(default_llm, monkeypatch):
    eng = default_llm.engine
    monkeypatch.setattr(eng.grammar, "mask", lambda logits, rows, matchers: None)
    other = eng.add_request("The capital of France is", SamplingParams(max_tokens=6, ignore_eos=True))
    bad = eng.add_request("The capital of France is", SamplingParams(max_tokens=6))
    bad.matcher = _FailedMatcher()
    while eng.has_unfinished():
        eng.step()
    assert bad.finish_reason == "abort" and "too many expressions" in bad.error and not bad.output_token_ids
    assert other.finish_reason == "length" and len(other.output_token_ids) == 6
