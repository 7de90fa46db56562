"""The OpenAI-compatible protocol as pydantic models (FastAPI publishes them in
/openapi.json and validates every body against them), their conversion to engine
requests, and the error envelope {"error": {"message", "type", "param", "code"}}.

Types are strict, as OpenAI's API is: a boolean is not an integer, a string is not a
number, NaN and Infinity are refused. Fields this server does not know are ignored (as
vLLM does), so clients written for OpenAI's API keep working. Fields it knows but does not
support are refused by name when they would change the output (UNSUPPORTED: functions,
use_beam_search, ...); the ones that change nothing here
(IGNORED) are accepted and ignored. docs/api.md lists both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from headwise.errors import InvalidParameterError
from headwise.sampling import MAX_N, REPETITION_PENALTY, SamplingParams
from headwise.server.tool_calls import ToolError, ToolPlan, message_for_template, plan
from headwise.structured import StructuredOutputs
from headwise.tokenizer import ChatOptions


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


# ---- requests -> engine --------------------------------------------------------------
@dataclass
class GenerationRequest:
    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_given: bool
    echo: bool = False                        # the prompt (completions) or last message (chat) leads the reply
    prompt_only: bool = False                 # max_tokens 0 with echo: the prompt (and its logprobs), no tokens
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: the context length


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputs | None:
    """The one structured-output constraint a request asks for, validated (400 naming the
    field otherwise); None for none (or response_format type "text")."""
    asked: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise bad('response_format: type "json_schema" needs a json_schema object', "response_format")
        asked.append(("response_format", {"json": rf.json_schema.json_schema}))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            asked.append((name, {kind: getattr(req, name)}))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        given = {k: v for k, v in (("json", so.json_), ("json_object", so.json_object), ("regex", so.regex),
                                    ("choice", so.choice), ("grammar", so.grammar)) if v not in (None, False)}
        asked.append(("structured_outputs", given))
    if not asked:
        return None
    if len(asked) > 1:
        raise bad(f"give one structured-output constraint, not {len(asked)} ({', '.join(a for a, _ in asked)})",
                  asked[1][0])
    param, spec = asked[0]
    try:
        return StructuredOutputs(**spec, param=param)
    except InvalidParameterError as e:
        raise bad(str(e), param) from None


def _logit_bias(req: CompletionRequest | ChatCompletionRequest) -> dict[int, float] | None:
    if req.logit_bias is None:
        return None
    out = {}
    for key, bias in req.logit_bias.items():
        if not (key.isascii() and key.isdigit()):
            raise bad(f"logit_bias keys must be token ids written as strings, got {key!r}", "logit_bias")
        out[int(key)] = float(bias)
    return out


def generation(req: CompletionRequest | ChatCompletionRequest, *, chat: bool,
               default_max_tokens: int | None) -> GenerationRequest:
    for name, default in UNSUPPORTED.items():
        if getattr(req, name) != default:
            raise bad(f"{name} is not supported by this server", name, "unsupported_parameter")
    if not chat:
        if req.best_of is not None and req.best_of > (req.n or 1) and req.stream:
            raise bad("best_of > n cannot be streamed: the best choices are known only at the end", "best_of")
        if req.max_tokens == 0 and not req.echo:
            raise bad("max_tokens 0 needs echo (the prompt scored, nothing generated)", "max_tokens")
        if req.suffix is not None and req.echo:
            raise bad("echo and suffix do not go together: the reply is the middle", "suffix")
    name, max_tokens = "max_tokens", req.max_tokens
    if chat and req.max_completion_tokens is not None:
        name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    prompt_only = not chat and max_tokens == 0
    if prompt_only:
        max_tokens = 1  # one step computes the prompt; its token is not reported
    given = max_tokens is not None
    prompt_lp = req.prompt_logprobs
    if not chat and req.echo and req.logprobs is not None:  # the echoed prompt's tokens get logprobs too
        prompt_lp = max(prompt_lp or 0, req.logprobs)
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
        max_tokens=max_tokens if given else max(default_max_tokens or 16, req.min_tokens or 0),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        seed=req.seed, stop=req.stop, logprobs=logprobs, ignore_eos=req.ignore_eos,
        stop_token_ids=req.stop_token_ids or [], n=req.n or 1, best_of=None if chat else req.best_of,
        min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req), min_tokens=req.min_tokens or 0,
        structured_outputs=structured_outputs(req), allowed_token_ids=req.allowed_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
        prompt_logprobs=prompt_lp, bad_words=req.bad_words,
    )
    try:
        params = SamplingParams(**kwargs)
    except InvalidParameterError as e:
        param = name if e.param == "max_tokens" else e.param
        raise bad(str(e).replace(e.param, param, 1), param) from None
    include_usage = req.stream_options.include_usage if req.stream_options else False
    if req.truncate_prompt_tokens == 0:
        raise bad("truncate_prompt_tokens must be -1 (the context length) or at least 1", "truncate_prompt_tokens")
    return GenerationRequest(req.model, params, req.stream, include_usage, given, req.echo, prompt_only,
                             req.truncate_prompt_tokens)


def chat_options(req: ChatCompletionRequest | TokenizeRequest, tools: ToolPlan | None = None) -> ChatOptions:
    try:
        return ChatOptions(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs or {},
                           (tools.tools or None) if tools is not None else None)
    except InvalidParameterError as e:
        raise bad(str(e), e.param) from None


def tool_constraint(p: ToolPlan) -> StructuredOutputs:
    """The structured-output constraint of tool_choice "required" or a named function."""
    try:
        return StructuredOutputs(json=p.schema, param="tools")
    except InvalidParameterError as e:
        raise bad(f"a tool's parameters do not compile: {e}", "tools") from None


def chat_echo(req: ChatCompletionRequest) -> str:
    """What `echo` puts before a chat reply: the last message's content where the reply
    continues its role (the assistant's, or the last message's own without
    add_generation_prompt), as vLLM does."""
    if not req.echo:
        return ""
    last = chat_messages(req.messages[-1:])[0]
    role = "assistant" if req.add_generation_prompt else last["role"]
    return last["content"] if last["role"] == role else ""


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as chat templates read them (tool calls' arguments as objects)."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # [{type: text, text: ...}, ...]
            content = "".join(p.text for p in content)
        d = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        out.append(message_for_template(d))
    return out


def tool_plan(req: ChatCompletionRequest, chat_template: str | None) -> ToolPlan | None:
    """The request's tools and tool_choice, checked against each other and the model's
    template (400 naming the field otherwise); None without tools."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    try:
        p = plan(tools, choice, chat_template)
    except ToolError as e:
        raise bad(str(e), e.param) from None
    if p is not None and p.schema is not None and structured_outputs(req) is not None:
        raise bad(f'tool_choice "{p.mode}" constrains the output already; drop the other constraint', "tool_choice")
    return p


def completion_prompts(req: CompletionRequest) -> list["str | list[int]"]:
    """The request's prompts: one (a string or token ids) or a batch (a list of either);
    at most MAX_PROMPTS, each non-empty."""
    p = req.prompt
    one = isinstance(p, str) or (len(p) > 0 and all(isinstance(t, int) for t in p))
    prompts = [p] if one else list(p)
    if not prompts:
        raise bad("the prompt is empty", "prompt")
    choices = max(req.n or 1, req.best_of or 1)
    if len(prompts) * choices > MAX_PROMPTS:
        raise bad(f"{len(prompts)} prompts x {choices} choices is more than {MAX_PROMPTS} in one request",
                  "prompt")
    if any(not q for q in prompts):
        raise bad("the prompt is empty" if one else "a prompt of the batch is empty", "prompt")
    return prompts
