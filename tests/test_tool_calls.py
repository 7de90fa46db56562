"""Tool calling's plumbing without a model: which constraint each tool_choice puts on the
output, how replies become tool calls (Hermes tags, bare JSON, the constrained forms), and
streaming that sends content as it comes and the calls whole at the end."""
import json

import jsonschema
import pytest

from headwise.server.tool_calls import StreamParser, ToolError, message_for_template, parse, plan

HERMES_TEMPLATE = "{% for t in tools %}{{ t | tojson }}{% endfor %} <tool_call> ... </tool_call>"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


@pytest.mark.parametrize("tools, choice, template, param", [
    (None, "auto", HERMES_TEMPLATE, "tool_choice"),
    ([WEATHER, WEATHER], "auto", HERMES_TEMPLATE, "tools"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, HERMES_TEMPLATE, "tool_choice"),
    (TOOLS, "auto", "{{ messages }}", "tool_choice"),   # a template with no call format headwise reads
    (TOOLS, None, None, "tool_choice"),
])
def test_choices_that_cannot_be_honoured_name_the_field(tools, choice, template, param):
    with pytest.raises(ToolError) as e:
        plan(tools, choice, template)
    assert e.value.param == param


def test_each_choice_constrains_as_it_should():
    assert plan(None, None, None) is None and plan(None, "none", None) is None
    none = plan(TOOLS, "none", HERMES_TEMPLATE)
    assert none.tools == [] and none.schema is None  # the model is not shown them
    auto = plan(TOOLS, None, HERMES_TEMPLATE)
    assert auto.mode == "auto" and auto.schema is None and auto.tools == TOOLS
    named = plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, "{{ messages }}")
    assert named.schema == WEATHER["function"]["parameters"] and named.name == "get_weather"
    required = plan(TOOLS, "required", "{{ messages }}")
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good, required.schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "other", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required.schema)


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_replies():
    auto = plan(TOOLS, "auto", HERMES_TEMPLATE)
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}')  # the last one never closed
    content, calls = parse(text, auto)
    assert content == "Let me look.\n"
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    broken = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": '
    assert parse(broken, auto) == (broken, [])  # not a call: the text is the reply
    assert parse("Just text.", auto) == ("Just text.", [])
    # bare JSON naming a given tool (Qwen2.5-Coder-0.5B writes calls so), one or a list
    assert _calls(parse(' {"name": "get_weather", "arguments": {"city": "Rome"}}\n', auto)[1]) == \
        [("get_weather", {"city": "Rome"})]
    two = '{"name": "get_time", "arguments": {}}\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert [n for n, _ in _calls(parse(two, auto)[1])] == ["get_time", "get_weather"]
    other = '{"name": "hello_world", "arguments": {}}'
    assert parse(other, auto) == (other, [])  # not one of the tools: content


def test_constrained_replies():
    named = plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    content, calls = parse('{ "city" : "Paris" }', named)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Paris"})]
    required = plan(TOOLS, "required", None)
    content, calls = parse('[{"name": "get_time", "arguments": {"tz": "UTC"}}]', required)
    assert content is None and _calls(calls) == [("get_time", {"tz": "UTC"})]
    assert parse('[{"name": "get_ti', required) == ('[{"name": "get_ti', [])  # cut short by max_tokens


@pytest.mark.parametrize("text, content, names", [
    ('Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Sure.\n", ["get_time"]),
    ("Plain text with a < sign and <tool_ in it, no call.", "Plain text with a < sign and <tool_ in it, no call.",
     []),
    ('  {"name": "get_weather", "arguments": {"city": "Bern"}}', "", ["get_weather"]),
    ('{"not": "a call"}', '{"not": "a call"}', []),
])
def test_streaming_sends_content_as_it_comes_and_calls_at_the_end(text, content, names):
    p = StreamParser(plan(TOOLS, "auto", HERMES_TEMPLATE))
    sent = []
    for ch in text:  # one character per update: tags split every way
        sent.append(p.feed(ch))
        assert content.startswith("".join(sent))  # nothing sent that turns out to be a call
    rest, calls = p.finish()
    assert "".join(sent) + rest == content and [c.name for c in calls] == names
    if names:  # the content went out before the call began, not at the end
        assert rest == "" and "".join(sent) == content


def test_history_arguments_reach_the_template_as_objects():
    m = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]}
    out = message_for_template(m)
    assert out["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out["tool_calls"][1]["function"]["arguments"] == "not json"
    assert m["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is not edited
