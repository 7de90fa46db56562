"""The server's sampling API: response_format and vLLM's guided_* / structured_outputs,
n choices (plain and streamed), penalties and logit_bias, and the fields refused by name
or ignored. The official openai client's `beta.chat.completions.parse` with a pydantic
model is run against `headwise serve` on the default model."""
import json
import math
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from headwise.server.protocol import IGNORED, UNSUPPORTED
from tests.test_server import running_server

CHAT = [{"role": "user", "content": "Alice is 31 and lives in Paris. Give her as JSON."}]


@pytest.fixture(scope="module")
def server():
    # Eager: what is tested is the API, and compiling the bfloat16 decode step for it
    # would cost a fresh machine ~80 s (tests/test_decode_capture.py tests the compile).
    with running_server(None, kv_cache_memory=1 << 26, max_model_len=1024, enforce_eager=True) as s:
        yield s[0]


def _chat(url, **body):
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT} | body, timeout=120)


class Person(BaseModel):
    name: str
    age: int


def test_openai_client_parse_with_a_pydantic_model(server):
    client = openai.OpenAI(api_key="none", base_url=f"{server}/v1")
    done = client.beta.chat.completions.parse(model="SmolLM2-135M-Instruct", messages=CHAT,
                                              response_format=Person, max_tokens=60, temperature=0)
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


@pytest.mark.parametrize("field, value, check", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
        "additionalProperties": False}}}, "schema"),
    ("guided_json", {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                     "additionalProperties": False}, "schema"),
    ("guided_regex", "[0-9]{2}", "regex"),
    ("guided_choice", ["Paris", "Rome"], "choice"),
    ("structured_outputs", {"choice": ["yes", "no"]}, "choice"),
])
def test_every_constraint_field_constrains(server, field, value, check):
    r = _chat(server, max_tokens=60, temperature=0, **{field: value})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    if check == "schema":
        schema = value["json_schema"]["schema"] if field == "response_format" else value
        jsonschema.validate(json.loads(text), schema)
    elif check == "regex":
        assert text.isdigit() and len(text) == 2
    else:
        allowed = value if isinstance(value, list) else value["choice"]
        assert text in allowed


def test_completions_take_constraints_too(server):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Is Paris in France? Answer:", "max_tokens": 4,
                                                     "guided_choice": [" yes", " no"]}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in (" yes", " no")


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"guided_regex": "(("}, "guided_regex", "unclosed"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured-output"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 500}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens", "min_tokens"),
    ({"n": 0}, "n", "n"),
])
def test_bad_sampling_fields_are_400_naming_the_field(server, body, param, words):
    r = _chat(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize("field", sorted(UNSUPPORTED))
def test_unsupported_fields_are_refused_by_name(server, field):
    value = {"use_beam_search": True}.get(field, [{"x": 1}])
    r = _chat(server, max_tokens=2, **{field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert r.json()["error"]["code"] == "unsupported_parameter"


def test_ignored_fields_change_nothing(server):
    plain = _chat(server, max_tokens=8, temperature=0).json()["choices"][0]["message"]["content"]
    extra = {f: "x" for f in IGNORED if "." not in f}
    r = _chat(server, max_tokens=8, temperature=0, **extra)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain


def test_n_choices_plain_and_streamed(server):
    r = _chat(server, max_tokens=8, n=3, temperature=1.0, seed=5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in body["choices"]]
    out = sum(1 for _ in texts)
    assert body["usage"]["completion_tokens"] >= out and body["usage"]["prompt_tokens"] > 0
    streamed = {0: "", 1: "", 2: ""}
    usage = None
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=120,
                      json={"messages": CHAT, "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 5,
                            "stream": True, "stream_options": {"include_usage": True}}) as s:
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            for c in d["choices"]:
                streamed[c["index"]] += c["delta"].get("content", "")
            usage = d.get("usage") or usage
    assert [streamed[i] for i in range(3)] == texts  # same seeds, same choices
    assert usage == body["usage"] | {"prompt_tokens_details": usage["prompt_tokens_details"]}


def test_penalties_and_bias_reach_the_sampler(server):
    plain = _chat(server, max_tokens=6, temperature=0, logprobs=True).json()["choices"][0]
    first = plain["logprobs"]["content"][0]["token"]
    ids = httpx.post(f"{server}/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    biased = _chat(server, max_tokens=6, temperature=0, logit_bias={str(ids[0]): -100}).json()["choices"][0]
    assert not biased["message"]["content"].startswith(first)
    r = _chat(server, max_tokens=6, temperature=0, presence_penalty=2, frequency_penalty=2,
              repetition_penalty=1.5, min_p=0.1, min_tokens=6)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6


def _complete(url, **body):
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_continue_final_message_echo_and_template_variables(server):
    conv = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite fruit is"}]
    opts = {"add_generation_prompt": False, "continue_final_message": True}
    r = httpx.post(f"{server}/v1/chat/completions", timeout=120,
                   json={"messages": conv, "max_tokens": 5, "temperature": 0, **opts})
    assert r.status_code == 200, r.text
    cont = r.json()
    opened = httpx.post(f"{server}/tokenize", json={"messages": conv, **opts}).json()
    answered = httpx.post(f"{server}/tokenize", json={"messages": conv}).json()
    assert cont["usage"]["prompt_tokens"] == opened["count"] != answered["count"]
    echoed = httpx.post(f"{server}/v1/chat/completions", timeout=120,
                        json={"messages": conv, "max_tokens": 5, "temperature": 0, "echo": True, **opts}).json()
    text = cont["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "My favourite fruit is" + text
    streamed = ""
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=120,
                      json={"messages": conv, "max_tokens": 5, "temperature": 0, "echo": True, "stream": True,
                            **opts}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["delta"].get("content", "")
    assert streamed == "My favourite fruit is" + text
    # echo repeats only a message of the reply's role: here the user's is not repeated
    plain = _chat(server, max_tokens=4, temperature=0).json()["choices"][0]["message"]["content"]
    assert _chat(server, max_tokens=4, temperature=0, echo=True).json()["choices"][0]["message"]["content"] == plain
    # a template variable SmolLM2's template does not read changes nothing; a reserved one is refused
    r = _chat(server, max_tokens=4, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10 ** 7]}, "allowed_token_ids"),
    ({"allowed_token_ids": [2], "min_tokens": 1}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 10 ** 6}, "truncate_prompt_tokens"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
])
def test_bad_chat_and_output_fields_are_400_naming_the_field(server, body, param):
    r = _chat(server, max_tokens=4, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_stop_strings_special_tokens_and_allowed_ids(server):
    plain = _complete(server, prompt="1, 2, 3,", max_tokens=10, temperature=0).json()["choices"][0]["text"]
    assert plain.startswith(" 4, 5")
    cut = _complete(server, prompt="1, 2, 3,", max_tokens=10, temperature=0, stop=[" 5"]).json()["choices"][0]
    kept = _complete(server, prompt="1, 2, 3,", max_tokens=10, temperature=0, stop=[" 5"],
                     include_stop_str_in_output=True).json()["choices"][0]
    assert cut["text"] == " 4," and kept["text"] == " 4, 5" and kept["finish_reason"] == "stop"
    hi = [{"role": "user", "content": "Say hi."}]
    chat = _chat(server, max_tokens=60, temperature=0, messages=hi).json()["choices"][0]
    special = _chat(server, max_tokens=60, temperature=0, messages=hi, skip_special_tokens=False,
                    include_stop_str_in_output=True).json()["choices"][0]
    assert chat["finish_reason"] == "stop"
    assert special["message"]["content"] == chat["message"]["content"] + "<|im_end|>"
    digits = [httpx.post(f"{server}/tokenize", json={"prompt": str(d), "add_special_tokens": False}).json()["tokens"][0]
              for d in range(10)]
    r = _complete(server, prompt="1, 2, 3,", max_tokens=6, temperature=1.0, seed=2, allowed_token_ids=digits)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].isdigit(), r.text
    paris = _complete(server, prompt="The capital of France is", max_tokens=4, temperature=0).json()
    assert "Paris" in paris["choices"][0]["text"]
    r = _complete(server, prompt="The capital of France is", max_tokens=4, temperature=0, bad_words=["Paris"])
    assert r.status_code == 200 and "Paris" not in r.json()["choices"][0]["text"], r.text
    # a constraint and allowed_token_ids with nothing in common: the request fails, cleanly
    r = _chat(server, max_tokens=4, guided_choice=["yes", "no"], allowed_token_ids=digits)
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_token_allowed", r.text


def test_completion_echo_and_prompt_truncation(server):
    plain = _complete(server, prompt="1, 2, 3,", max_tokens=3, temperature=0).json()
    echoed = _complete(server, prompt="1, 2, 3,", max_tokens=3, temperature=0, echo=True).json()
    assert echoed["choices"][0]["text"] == "1, 2, 3," + plain["choices"][0]["text"]
    assert echoed["usage"] == plain["usage"] | {"prompt_tokens_details": echoed["usage"]["prompt_tokens_details"]}
    ids = httpx.post(f"{server}/tokenize", json={"prompt": "1, 2, 3,"}).json()["tokens"]
    by_ids = _complete(server, prompt=ids, max_tokens=3, temperature=0, echo=True).json()
    assert by_ids["choices"][0]["text"] == echoed["choices"][0]["text"]
    # the prompt's last k tokens only: as if they had been sent alone
    long = "Paris is the capital of France. " * 8 + "1, 2, 3,"
    tail = _complete(server, prompt=long, max_tokens=3, temperature=0, truncate_prompt_tokens=len(ids)).json()
    assert tail["usage"]["prompt_tokens"] == len(ids)
    assert tail["choices"][0]["text"] == by_ids["choices"][0]["text"][len("1, 2, 3,"):]


def test_suffix_needs_fill_in_the_middle_tokens(server):
    r = _complete(server, prompt="def f(", suffix="):\n    pass", max_tokens=4)
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"  # SmolLM2 has none
    assert "fill-in-the-middle" in r.json()["error"]["message"]
    r = _complete(server, prompt="def f(", suffix=")", echo=True, max_tokens=4)
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_version(server):
    import headwise

    assert httpx.get(f"{server}/version").json() == {"version": headwise.__version__}


def test_scoring_a_prompt_with_echo_and_prompt_logprobs(server):
    """How scoring clients (lm-eval's loglikelihood) ask: max_tokens 0, echo, logprobs."""
    prompt = "The capital of France is Paris"
    r = _complete(server, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == prompt and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v < 0 for v in lp["token_logprobs"][1:])
    assert r.json()["usage"]["completion_tokens"] == 0
    for tokstr, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert tokstr in top and top[tokstr] == v and max(top.values()) >= v and len(top) in (2, 3)
    # vLLM's own field gives the same numbers, with ranks
    pl = _complete(server, prompt=prompt, max_tokens=1, prompt_logprobs=2, temperature=0).json()["choices"][0]
    ids = httpx.post(f"{server}/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert pl["prompt_logprobs"][0] is None and len(pl["prompt_logprobs"]) == len(ids)
    for p in range(1, len(ids)):
        mine = pl["prompt_logprobs"][p][str(ids[p])]
        assert abs(mine["logprob"] - lp["token_logprobs"][p]) < 1e-3
        assert (mine["rank"] == 1) == (mine["logprob"] >= max(e["logprob"] for e in pl["prompt_logprobs"][p].values()))
    # streamed: the same prompt part first, then a last chunk with nothing generated
    chunks = []
    with httpx.stream("POST", f"{server}/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"] == prompt
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]
    assert [c["choices"][0]["text"] for c in chunks[1:]] == [""] and chunks[-1]["choices"][0]["finish_reason"]
    # echo with logprobs and generated tokens: the prompt's part, then the generated part
    gen = _complete(server, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0).json()["choices"][0]
    alone = _complete(server, prompt=prompt, max_tokens=3, logprobs=1, temperature=0).json()["choices"][0]
    assert gen["text"] == prompt + alone["text"]
    assert gen["logprobs"]["tokens"] == lp["tokens"] + alone["logprobs"]["tokens"]
    chat = _chat(server, max_tokens=1, prompt_logprobs=0).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    r = _complete(server, prompt=prompt, max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_and_required_tool_choice_through_the_openai_client(server):
    client = openai.OpenAI(api_key="none", base_url=f"{server}/v1")
    named = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=40, temperature=0)
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert named.choices[0].finish_reason == "stop" and named.choices[0].message.content is None
    body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 60, "temperature": 0}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120).json()
    calls = r["choices"][0]["message"]["tool_calls"]
    assert r["choices"][0]["finish_reason"] == "tool_calls" and calls
    for c in calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[c["function"]["name"]]
        jsonschema.validate(json.loads(c["function"]["arguments"]), tool["function"]["parameters"])
    streamed = []
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body | {"stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])["choices"][0]
                streamed += d["delta"].get("tool_calls", [])
                assert not d["delta"].get("content")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert [c["index"] for c in streamed] == list(range(len(calls)))


def test_tool_fields_refused_or_passed_on(server):
    def post(**body):
        return httpx.post(f"{server}/v1/chat/completions", timeout=120, json={"messages": ASK, "max_tokens": 4} | body)

    r = post(tools=[WEATHER])  # auto: SmolLM2's template teaches no call format
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post(tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post(tools=[{"type": "function", "function": {"name": "bad name!"}}], tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    plain = post(temperature=0).json()["choices"][0]["message"]["content"]
    none = post(temperature=0, tools=[WEATHER], tool_choice="none").json()["choices"][0]["message"]
    assert none["content"] == plain and "tool_calls" not in none  # not shown, not parsed
    # a conversation carrying an earlier call and its result
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"}]
    r = httpx.post(f"{server}/v1/chat/completions", timeout=120, json={"messages": history, "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_a_batch_of_prompts_answers_each_as_alone(server):
    # Each prompt longer than the decode kernels' row counts (layers/int4.py
    # INT4_MAX_ROWS): alone or side by side, its prefill runs the same matmul, whose rows
    # are summed alike however many there are (a prompt of a few tokens alone would take
    # the decode kernel, whose sums differ in the last bits: a sample at temperature 1 can
    # then differ).
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8, 9,", "The capital of France, the largest city of the country, is"]
    body = {"prompt": prompts, "max_tokens": 4, "temperature": 1.0, "seed": 7, "n": 2}
    r = _complete(server, **body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    alone = [_complete(server, **body | {"prompt": p}).json() for p in prompts]
    assert [c["text"] for c in r["choices"]] == [c["text"] for a in alone for c in a["choices"]]
    assert r["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert r["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    streamed = {i: "" for i in range(4)}
    with httpx.stream("POST", f"{server}/v1/completions", json=body | {"stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] += c["text"]
    assert [streamed[i] for i in range(4)] == [c["text"] for c in r["choices"]]
    ids = [httpx.post(f"{server}/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    by_ids = _complete(server, **body | {"prompt": ids}).json()
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in r["choices"]]


@pytest.mark.parametrize("prompt, code", [
    (["fine", ""], "invalid_parameter"),
    (["fine"] * 600, "invalid_parameter"),  # x n=2: more choices than one request may ask
    # tokenized, it is too long: the first prompt was submitted by then, and is aborted
    (["fine", "word " * 1100], "context_length_exceeded"),
])
def test_a_batch_with_a_bad_prompt_runs_none_of_it(server, prompt, code):
    r = _complete(server, prompt=prompt, max_tokens=1000, n=2, ignore_eos=True)
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    for _ in range(100):  # the abort reaches the engine thread within a step or two
        metrics = httpx.get(f"{server}/metrics").text
        running = [line for line in metrics.splitlines() if line.startswith("headwise:num_requests_running{")]
        if running and all(line.endswith(" 0.0") for line in running):
            return
        time.sleep(0.05)
    raise AssertionError(f"still running: {running}")


def test_best_of_returns_the_best_n_of_a_batch(server):
    # Each prompt's best_of choices are its n=best_of choices with the same seeds; the
    # best n by cumulative logprob come back, in order, indexed k * n + j; usage counts
    # every choice sampled.
    prompts = ["Once upon a time", "The recipe starts with"]
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 1.3, "seed": 3}
    every = _complete(server, **body, n=4, logprobs=0).json()["choices"]
    sums = [math.fsum(c["logprobs"]["token_logprobs"]) for c in every]
    want = [k * 4 + j for k in range(2) for j in sorted(range(4), key=lambda j: -sums[k * 4 + j])[:2]]
    assert want != [0, 1, 4, 5]  # a real ranking, not the first n
    r = _complete(server, **body, n=2, best_of=4).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in r["choices"]] == [every[i]["text"] for i in want]
    assert all(c["logprobs"] is None for c in r["choices"])  # not asked for
    asked = _complete(server, **body, n=2, best_of=4, logprobs=0).json()["choices"]
    assert [c["logprobs"]["token_logprobs"] for c in asked] == [every[i]["logprobs"]["token_logprobs"] for i in want]
    alone = _complete(server, **body, n=4).json()
    assert r["usage"] == alone["usage"] | {"prompt_tokens_details": r["usage"]["prompt_tokens_details"]}
