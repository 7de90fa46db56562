"""The OpenAI-compatible protocol as pydantic models (FastAPI publishes them in
/openapi.json and validates every body against them) and the error envelope
{"error": {"message", "type", "param", "code"}}. server/inputs.py turns a validated
request into engine inputs.

Types are strict, as OpenAI's API is: a boolean is not an integer, a string is not a
number, NaN and Infinity are refused. Fields this server does not know are ignored (as
vLLM does), so clients written for OpenAI's API keep working. Fields it knows but does not
support are refused by name when they would change the output (UNSUPPORTED: functions,
use_beam_search, ...); the ones that change nothing here
(IGNORED) are accepted and ignored. docs/api.md lists both.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from headwise.sampling import MAX_N, REPETITION_PENALTY


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


class JSONSchemaFormat(_Model):
    name: StrictStr | None = None
    description: StrictStr | None = None
    # `schema` is a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | StrictBool = Field(alias="schema", description="the JSON schema")
    strict: StrictBool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(_Model):
    """vLLM's `structured_outputs` extra: exactly one of these."""
    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None


# Fields that would change the output and are not supported: refused by name when they
# hold anything but their default (the second element).
UNSUPPORTED: dict[str, Any] = {
    "functions": None, "function_call": None, "audio": None,
    "prediction": None, "web_search_options": None, "use_beam_search": False,
    # A template from the request runs on the server; vLLM too takes one only when told to trust it.
    "chat_template": None,
}
# Accepted and ignored: they change nothing this server computes (vLLM ignores them too).
IGNORED = ("user", "store", "metadata", "service_tier", "parallel_tool_calls", "guided_decoding_backend",
           "guided_whitespace_pattern", "stream_options.continuous_usage_stats", "priority", "request_id")


class _SamplingRequest(_Model):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: Number | None = Field(None, ge=0, description="0: greedy (default 1)")
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1, description="0 or -1: no limit")
    min_p: Number | None = Field(None, ge=0, le=1)
    n: StrictInt | None = Field(None, ge=1, le=MAX_N, description="choices per prompt")
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(None, ge=REPETITION_PENALTY[0], le=REPETITION_PENALTY[1],
                                              description="1: none (vLLM's semantics)")
    logit_bias: dict[str, Number] | None = Field(None, description="token id (a string) -> bias in [-100, 100]")
    min_tokens: StrictInt | None = Field(None, ge=0)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    seed: StrictInt | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    allowed_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = Field(
        None, min_length=1, description="only these token ids may be sampled")
    include_stop_str_in_output: StrictBool = Field(False, description="keep the matched stop string (or stop "
                                                                      "token's text) at the end of the output")
    skip_special_tokens: StrictBool = True
    truncate_prompt_tokens: StrictInt | None = Field(
        None, ge=-1, description="keep only the prompt's last k tokens (-1: the model's context length)")
    bad_words: list[StrictStr] | None = Field(None, description="words the output may not contain")
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20, description="logprobs of the prompt's tokens, "
                                                                         "with the top k at each (vLLM)")
    # Declared so that they can be refused by name (UNSUPPORTED), not silently dropped.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    use_beam_search: Any = False
    chat_template: Any = None


# Choices (prompts x n) in one completions request at most.
MAX_PROMPTS = 1024


class CompletionRequest(_SamplingRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]] = Field(
        description="a string or token ids, or a batch: a list of either")
    # 0 only with echo: the prompt scored, nothing generated (how scoring clients ask)
    max_tokens: StrictInt | None = Field(None, ge=0, description="tokens to generate at most (0: only with echo)")
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(None, ge=1)


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Model):
    name: StrictStr
    arguments: StrictStr = Field(description="a JSON object, as text")


class ToolCallMessage(_Model):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallMessage] | None = None   # an assistant's calls, earlier in the conversation
    tool_call_id: StrictStr | None = None             # a tool message: the call it answers


class FunctionDef(_Model):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: StrictBool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: StrictStr


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    add_generation_prompt: StrictBool = Field(True, description="end the prompt with the assistant's turn opened")
    continue_final_message: StrictBool = Field(False, description="continue the last (assistant) message; "
                                                                  "needs add_generation_prompt=false")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="variables for the chat template")
    echo: StrictBool = Field(False, description="start the reply with the last message's content when the "
                                                "reply continues that message's role (vLLM)")
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class TokenizeRequest(_Model):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    # With messages, as on chat requests:
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None


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
    content: str | None
    tool_calls: list[ToolCallMessage] | None = None


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
