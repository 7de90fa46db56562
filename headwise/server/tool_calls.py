"""Tool calling for chat requests: which constraint a `tool_choice` puts on the output,
and how the output becomes OpenAI's `tool_calls`.

- "auto": the model writes calls in its chat template's own format, parsed after. The one
  format read here is the Hermes one Qwen2.5's templates teach (a JSON object with "name"
  and "arguments" between <tool_call> and </tool_call>); a template that teaches no format
  this module reads gets a 400 for "auto", as vLLM gives one without a tool parser. A
  reply that is nothing but such JSON objects, without the tags, naming given tools, is
  read as calls too: Qwen2.5-Coder-0.5B writes them so.
- "required": the output is constrained (structured outputs) to a JSON array of one or
  more calls of the given functions, each {"name", "arguments"} with the function's
  parameter schema.
- a named function: the output is constrained to that function's parameter schema, and is
  its arguments.
- "none": the tools are not shown to the model and nothing is parsed.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# A call's body: up to its closing tag, or to the end (a reply cut short, or a model that
# stops without closing the last call).
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + "|$)", re.DOTALL)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of generation and of the reply."""
    mode: str                          # "none" | "auto" | "required" | "named"
    tools: list[dict]                  # for the template ([] with "none")
    schema: dict | None = None         # the JSON schema the output is held to (required, named)
    name: str | None = None            # the named function


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                     # a JSON object, as text (OpenAI's form)

    def as_json(self) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolError(ValueError):
    """A tool field the request or the model cannot honour, naming it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def hermes_format(chat_template: str | None) -> bool:
    return bool(chat_template) and HERMES_OPEN in chat_template


def plan(tools: list[dict] | None, choice: str | dict | None, chat_template: str | None) -> ToolPlan | None:
    """The plan for a request's `tools` (OpenAI's function tools, as plain dicts) and
    `tool_choice`; None without tools. Raises ToolError for a choice the request or the
    model cannot honour."""
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("tools", "two tools have the same name")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan("none", [])
    if choice == "auto":
        if not hermes_format(chat_template):
            raise ToolError("tool_choice", 'this model\'s chat template teaches no tool-call format headwise '
                            'reads (Hermes <tool_call>); use tool_choice "required" or a named function')
        return ToolPlan("auto", tools)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": _parameters(t)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return ToolPlan("required", tools, schema)
    name = choice["function"]["name"]
    if name not in names:
        raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return ToolPlan("named", tools, _parameters(tools[names.index(name)]), name)


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def parse(text: str, p: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    """The reply's content and its tool calls. "auto" output without a well-formed call
    stays content, as it came."""
    if p.mode == "named":
        return None, [ToolCall(p.name, _compact(text))]
    if p.mode == "required":
        try:
            return None, [ToolCall(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):  # cut short (length): what came stays content
            return text, []
    if p.mode != "auto":
        return text, []
    if HERMES_OPEN not in text:
        calls = _bare_calls(text, {t["function"]["name"] for t in p.tools})
        return (None, calls) if calls else (text, [])
    calls = []
    for body in _HERMES.findall(text[text.index(HERMES_OPEN):]):
        try:
            obj = json.loads(body)
            args = obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(obj["name"], str) or not isinstance(args, dict):
                raise TypeError
        except (ValueError, TypeError, KeyError, AttributeError):
            return text, []  # not a call after all: the text is the reply
        calls.append(ToolCall(obj["name"], json.dumps(args)))
    content = text[: text.index(HERMES_OPEN)]
    return content if content.strip() else None, calls


def _bare_calls(text: str, names: set[str]) -> list[ToolCall]:
    """Calls written as bare JSON: one object, a list of them, or one per line, each with
    a "name" among the tools and "arguments" an object; else none."""
    s = text.strip()
    try:
        objs = json.loads(s)
    except ValueError:
        try:
            objs = [json.loads(line) for line in s.splitlines() if line.strip()]
        except ValueError:
            return []
    objs = objs if isinstance(objs, list) else [objs]
    calls = []
    for o in objs:
        if not (isinstance(o, dict) and o.get("name") in names and isinstance(o.get("arguments"), dict)):
            return []
        calls.append(ToolCall(o["name"], json.dumps(o["arguments"])))
    return calls


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except ValueError:  # cut short by max_tokens: given as it came
        return text


def message_for_template(m: dict) -> dict:
    """An OpenAI chat message as chat templates read it: a tool call's arguments as an
    object, not JSON text (Qwen2.5's template writes them with `tojson`)."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        f = dict(c["function"])
        try:
            args = json.loads(f["arguments"])
            if isinstance(args, dict):
                f["arguments"] = args
        except ValueError:
            pass  # not JSON: the template gets the text
        out.append(dict(c, function=f))
    return dict(m, tool_calls=out)


class StreamParser:
    """One streamed choice's text split into content, sent as it comes, and tool calls,
    sent whole at the end. "auto": content until a call begins (text that could be the
    start of one is held back); "required" and named: everything is a call."""

    def __init__(self, p: ToolPlan) -> None:
        self.plan = p
        self.text = ""
        self.sent = 0       # characters of text sent as content
        self.in_call = p.mode in ("required", "named")

    def feed(self, new: str) -> str:
        """Take new text; returns the content that may be sent now."""
        self.text += new
        if self.in_call:
            return ""
        if self.sent == 0:
            head = self.text.lstrip()
            if not head:
                return ""  # only whitespace yet: it may lead a call
            if head[0] in "{[":  # a call written as bare JSON, maybe: held to the end
                self.in_call = True
                return ""
        at = self.text.find(HERMES_OPEN, max(0, self.sent - len(HERMES_OPEN)))
        if at >= 0:
            self.in_call = True
            end = at
        else:  # hold back a tail that could be the start of HERMES_OPEN
            end = len(self.text)
            for k in range(min(len(HERMES_OPEN) - 1, len(self.text)), 0, -1):
                if HERMES_OPEN.startswith(self.text[-k:]):
                    end -= k
                    break
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: content not sent yet, and the calls."""
        content, calls = parse(self.text, self.plan)
        if calls:
            return "", calls
        rest, self.sent = self.text[self.sent:], len(self.text)
        return rest, []
