"""The server's sampling API: response_format and vLLM's guided_* / structured_outputs,
n choices (plain and streamed), penalties and logit_bias, and the fields refused by name
or ignored. The official openai client's `beta.chat.completions.parse` with a pydantic
model is run against `headwise serve` on the default model."""
import json

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
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, **body}, timeout=120)


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
    value = {"include_stop_str_in_output": True, "use_beam_search": True, "skip_special_tokens": False,
             "continue_final_message": True, "add_generation_prompt": False}.get(field, [{"x": 1}])
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
