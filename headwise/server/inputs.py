"""Request bodies -> engine inputs: a validated CompletionRequest or ChatCompletionRequest
becomes SamplingParams (plus what the reply needs: stream, usage, echo), prompts,
structured-output constraints, chat messages and tool plans. Every refusal is a 400
naming the field (protocol.bad); nothing here touches the engine."""
from __future__ import annotations

from dataclasses import dataclass

from headwise.errors import InvalidParameterError
from headwise.sampling import SamplingParams
from headwise.server.protocol import (MAX_PROMPTS, UNSUPPORTED, ChatCompletionRequest, ChatMessage,
                                      CompletionRequest, NamedToolChoice, TokenizeRequest, bad)
from headwise.server.tool_calls import ToolError, ToolPlan, message_for_template, plan
from headwise.structured import StructuredOutputs
from headwise.tokenizer import ChatOptions


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
