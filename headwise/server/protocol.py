"""The OpenAI-compatible protocol as pydantic models (FastAPI publishes them in
/openapi.json and validates every body against them), their conversion to engine
requests, and the error envelope {"error": {"message", "type", "param", "code"}}.

Types are strict, as OpenAI's API is: a boolean is not an integer, a string is not a
number, NaN and Infinity are refused. Fields this server does not know are ignored (as
vLLM does), so clients written for OpenAI's API keep working; fields it knows but does
not support (n > 1, best_of, echo, suffix, batched prompts) are refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

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


def from_validation_errors(errors: list[dict]) -> APIError:
    """FastAPI's RequestValidationError details -> one 400 in the envelope, `param`
    naming the top-level field of the first error."""
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]
    kind = e.get("type", "")
    if kind == "json_invalid":
        return bad(f"request body is not valid JSON: {e.get('msg', '')}", None, "malformed_json")
    if not loc:
        return bad(f"request body must be a JSON object ({e.get('msg', '')})", None, "invalid_body")
    where = ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES)))
    return bad(f"{where}: {e.get('msg', 'invalid value')}", str(loc[0]))


# Names pydantic puts into an error's location for the member of a union that failed.
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict"}

Number = Union[StrictInt, StrictFloat]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---- requests ---------------------------------------------------------------------
class StreamOptions(_Model):
    include_usage: StrictBool = False


class _SamplingRequest(_Model):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: Number | None = Field(None, ge=0, description="0: greedy (default 1)")
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1, description="0 or -1: no limit")
    n: StrictInt | None = Field(None, ge=1, description="only 1 is supported")
    seed: StrictInt | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None


class CompletionRequest(_SamplingRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]] = Field(
        description="a string or a list of token ids (one prompt per request)")
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(None, ge=1)


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Model):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)


class TokenizeRequest(_Model):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(_Model):
    model: StrictStr | None = None
    tokens: list[StrictInt]


# ---- responses (documented in /openapi.json; built as plain dicts) -----------------
class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 413: {"model": ErrorResponse},
          500: {"model": ErrorResponse}, 503: {"model": ErrorResponse}}


# ---- requests -> engine --------------------------------------------------------------
@dataclass
class GenerationRequest:
    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_given: bool


def generation(req: CompletionRequest | ChatCompletionRequest, *, chat: bool,
               default_max_tokens: int | None) -> GenerationRequest:
    if (req.n or 1) != 1:
        raise bad("only n=1 is supported", "n", "unsupported_parameter")
    if not chat:
        if (req.best_of or 1) != 1:
            raise bad("best_of other than 1 is not supported", "best_of", "unsupported_parameter")
        if req.echo:
            raise bad("echo is not supported", "echo", "unsupported_parameter")
        if req.suffix:
            raise bad("suffix is not supported", "suffix", "unsupported_parameter")
    name, max_tokens = "max_tokens", req.max_tokens
    if chat and req.max_completion_tokens is not None:
        name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    given = max_tokens is not None
    if chat:
        if req.logprobs:
            logprobs = req.top_logprobs or 0
        elif req.top_logprobs is not None:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        else:
            logprobs = None
    else:
        logprobs = req.logprobs
    kwargs = dict(
        max_tokens=max_tokens if given else (default_max_tokens or 16),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        seed=req.seed, stop=req.stop, logprobs=logprobs, ignore_eos=req.ignore_eos,
        stop_token_ids=req.stop_token_ids or [],
    )
    try:
        params = SamplingParams(**kwargs)
    except InvalidParameterError as e:
        param = name if e.param == "max_tokens" else e.param
        raise bad(str(e).replace(e.param, param, 1), param) from None
    include_usage = req.stream_options.include_usage if req.stream_options else False
    return GenerationRequest(req.model, params, req.stream, include_usage, given)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # [{type: text, text: ...}, ...]
            content = "".join(p.text for p in content)
        out.append({"role": m.role, "content": content or ""})
    return out


def completion_prompt(req: CompletionRequest) -> "str | list[int]":
    p = req.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)):
        if not p:
            raise bad("the prompt is empty", "prompt")
        return p
    raise bad("batched prompts are not supported; send one prompt per request", "prompt",
              "unsupported_parameter")
