"""Request parsing and validation for the OpenAI-compatible endpoints, and the error
envelope {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from headwise.sampling import InvalidParameterError, SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str = "invalid_request_error", type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "service_unavailable_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_parameter") -> APIError:
    return APIError(400, message, param, code)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"request body is not valid JSON: {e}", None, "malformed_json") from None
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {type(body).__name__}", None, "invalid_body")
    return body


def _get(body: dict, name: str, types, default=None, check=None, msg: str = ""):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad(f"{name} must be {msg or types}, got {v!r}", name)
    if not isinstance(v, types) or (check is not None and not check(v)):
        raise bad(f"{name} must be {msg}, got {v!r}", name)
    return v


@dataclass
class GenerationRequest:
    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_given: bool


def sampling_from(body: dict, *, chat: bool, default_max_tokens: int | None) -> GenerationRequest:
    n = _get(body, "n", int, 1, lambda x: x >= 1, "a positive integer")
    if n != 1:
        raise bad("only n=1 is supported", "n", "unsupported_parameter")
    if _get(body, "best_of", int, 1, lambda x: x >= 1, "a positive integer") != 1:
        raise bad("best_of other than 1 is not supported", "best_of", "unsupported_parameter")
    if not chat and _get(body, "echo", bool, False, None, "a boolean"):
        raise bad("echo is not supported", "echo", "unsupported_parameter")
    if _get(body, "suffix", str, None, None, "a string"):
        raise bad("suffix is not supported", "suffix", "unsupported_parameter")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, name, int, None, None, "an integer >= 1")
    given = max_tokens is not None
    if not given:
        max_tokens = default_max_tokens
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise bad("stop must be a string or a list of strings", "stop")
    if chat:
        if _get(body, "logprobs", bool, False, None, "a boolean"):
            logprobs = _get(body, "top_logprobs", int, 0, lambda x: 0 <= x <= 20, "an integer in [0, 20]")
        else:
            if body.get("top_logprobs") is not None:
                raise bad("top_logprobs needs logprobs=true", "top_logprobs")
            logprobs = None
    else:
        logprobs = _get(body, "logprobs", int, None, lambda x: 0 <= x <= 20, "an integer in [0, 20]")
    stream = _get(body, "stream", bool, False, None, "a boolean")
    opts = _get(body, "stream_options", dict, {}, None, "an object")
    kwargs = dict(
        max_tokens=max_tokens if max_tokens is not None else 16,
        temperature=body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0,
        top_p=body.get("top_p") if body.get("top_p") is not None else 1.0,
        top_k=body.get("top_k") if body.get("top_k") is not None else 0,
        seed=body.get("seed"),
        stop=stop,
        logprobs=logprobs,
        ignore_eos=_get(body, "ignore_eos", bool, False, None, "a boolean"),
        stop_token_ids=_get(body, "stop_token_ids", list, [], None, "a list of token ids"),
    )
    try:
        params = SamplingParams(**kwargs)
    except InvalidParameterError as e:
        param = "max_completion_tokens" if e.param == "max_tokens" and name != "max_tokens" else e.param
        raise bad(str(e).replace(e.param, param, 1), param) from None
    except TypeError as e:  # comparisons of wrongly typed values
        raise bad(f"invalid sampling parameter: {e}") from None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    return GenerationRequest(model, params, stream, bool(opts.get("include_usage", False)), given)


def chat_messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{type: text, text: ...}, ...]
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise bad(f"messages[{i}].content supports text parts only", "messages")
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def completion_prompt(body: dict) -> "str | list[int]":
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    if isinstance(p, list) and len(p) > 1:
        raise bad("batched prompts are not supported; send one prompt per request", "prompt",
                  "unsupported_parameter")
    raise bad("prompt must be a string or a list of token ids", "prompt")
