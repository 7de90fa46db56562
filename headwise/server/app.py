"""`headwise serve`: OpenAI-compatible HTTP API over the async engine (FastAPI)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator

import jinja2
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import headwise
from headwise.engine.llm_engine import LLMEngine
from headwise.engine.request_checks import PromptTooLongError, check_params
from headwise.engine.scheduler import QueueFullError
from headwise.server import inputs, protocol as P
from headwise.errors import InvalidParameterError
from headwise.sampling import SamplingParams
from headwise.server.async_engine import AsyncEngine
from headwise.server.choices import ChoiceBatch, Choices
from headwise.server.engine_client import EngineClient, EngineUnavailableError, ShuttingDownError, Update
from headwise.server.replies import Logprobs, Reply, joined, total_usage
from headwise.server.tool_calls import StreamParser, ToolPlan
from headwise.tokenizer import ChatOptions
from headwise.server.guards import GracefulServer, GuardMiddleware, api_key_dependency, max_chars_per_token

DEFAULT_MAX_REQUEST_BYTES = 4 << 20


def _error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(engine: LLMEngine | EngineClient, served_model_name: str | None = None,
               max_queue: int | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The app over one engine (run on a thread here) or an EngineClient (e.g. Ray Serve
    replicas). api_key: required as a Bearer token on /v1/*, /tokenize, /detokenize and
    /reset_prefix_cache (/health and /metrics stay open). max_queue: an LLMEngine's only."""
    aeng = AsyncEngine(engine, max_queue) if isinstance(engine, LLMEngine) else engine
    model = aeng.model

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        aeng.close()

    app = FastAPI(title="headwise", version="0.1.0", docs_url=None, redoc_url=None, lifespan=lifespan,
                  description="OpenAI-compatible API of the headwise engine")
    app.add_middleware(GuardMiddleware, max_bytes=max_request_bytes)
    app.state.engine = aeng
    name = served_model_name or model.name
    created = int(time.time())
    tok = model.tokenizer
    vocab = model.vocab_size
    max_chars = model.max_model_len * max_chars_per_token(tok)
    logprobs = Logprobs(tok)
    api = APIRouter(dependencies=[Depends(api_key_dependency(api_key))], responses=P.ERRORS)

    @app.exception_handler(P.APIError)
    async def _api_error(_: Request, e: P.APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        return _error(P.from_validation_errors(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        # FastAPI's own refusals (unreadable body, unknown route, wrong method), enveloped.
        code = {400: "malformed_json", 404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return _error(P.APIError(e.status_code, str(e.detail), None, code))

    @app.get("/health")
    async def health():
        ok, body = await aeng.health()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/version")
    async def version():
        return {"version": headwise.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(await aeng.metrics_text(), media_type="text/plain; version=0.0.4")

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                             "owned_by": "headwise", "max_model_len": model.max_model_len}]}

    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget every cached prefix (running requests keep their KV)."""
        try:
            pages = await aeng.reset_prefix_cache()
        except EngineUnavailableError as e:
            raise P.APIError(503, str(e), None, "engine_unavailable") from None
        return {"status": "ok", "pages_freed": pages}

    def _refuse_long_text(chars: int, param: str) -> None:
        # Cheap and certain: no tokenization of this many characters fits the context.
        if chars > max_chars:
            raise P.APIError(400, f"the prompt has {chars} characters, more than any prompt of at most "
                             f"{model.max_model_len} tokens can have; shorten it", param,
                             "context_length_exceeded")

    async def _chat_ids(messages: list[P.ChatMessage], options: ChatOptions | None = None) -> list[int]:
        msgs = inputs.chat_messages(messages)
        _refuse_long_text(sum(len(m["content"]) for m in msgs), "messages")
        try:
            return await asyncio.to_thread(tok.encode_chat, msgs, options)
        except ValueError as e:  # no chat template; a final message that cannot be continued
            raise P.bad(str(e), "messages") from None
        except jinja2.TemplateError as e:  # the template refused the conversation (raise_exception)
            raise P.bad(f"the chat template refused the messages: {e}", "messages") from None

    def _truncated(ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last `keep` tokens (truncate_prompt_tokens; -1: the context length)."""
        if keep is None:
            return ids
        if keep > model.max_model_len:
            raise P.bad(f"truncate_prompt_tokens ({keep}) is more than the model's context length "
                        f"({model.max_model_len})", "truncate_prompt_tokens")
        keep = model.max_model_len if keep == -1 else keep
        return ids[-keep:]

    @api.post("/tokenize", response_model=P.TokenizeResponse)
    async def tokenize(req: P.TokenizeRequest):
        if req.messages is not None:
            ids = await _chat_ids(req.messages, inputs.chat_options(req))
        elif req.prompt is not None:
            _refuse_long_text(len(req.prompt), "prompt")
            ids = await asyncio.to_thread(tok.encode, req.prompt, req.add_special_tokens)
        else:
            raise P.bad("give prompt (a string) or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": model.max_model_len}

    @api.post("/detokenize", response_model=P.DetokenizeResponse)
    async def detokenize(req: P.DetokenizeRequest):
        if not all(0 <= t < vocab for t in req.tokens):
            raise P.bad(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    def _check_model(req: inputs.GenerationRequest) -> None:
        if req.model is not None and req.model != name:
            raise P.APIError(400, f"the model {req.model!r} does not exist; this server serves {name!r}",
                             "model", "model_not_found")

    async def _start(ids: list[int], req: inputs.GenerationRequest, chat: bool, request_id: str) -> Choices:
        """Check a prompt against the model and submit its first choice."""
        if chat and not req.max_tokens_given:
            req.params.max_tokens = max(1, model.max_model_len - len(ids))
        try:
            check_params(req.params.for_choice(0), vocab)
            ids = model.check(ids, req.params.max_tokens)
        except PromptTooLongError as e:
            raise P.APIError(400, str(e), "max_tokens" if len(ids) else "prompt", "context_length_exceeded") from None
        except InvalidParameterError as e:
            raise P.bad(str(e), e.param) from None
        except ValueError as e:
            raise P.bad(str(e), "prompt") from None

        async def submit(params: SamplingParams, rid: str):
            try:
                return await aeng.submit(ids, params, rid)
            except InvalidParameterError as e:  # a constraint that did not compile
                raise P.bad(str(e), e.param) from None
            except QueueFullError as e:
                raise P.APIError(503, str(e), None, "queue_full") from None
            except ShuttingDownError as e:
                raise P.APIError(503, str(e), None, "shutting_down") from None
            except EngineUnavailableError as e:
                raise P.APIError(503, str(e), None, "engine_unavailable") from None

        choices = Choices(aeng, submit, req.params, request_id)
        await choices.start()
        return choices

    async def _collect(request: Request, choices: ChoiceBatch) -> list[list[Update]] | None:
        """Every choice's updates; None if the client went away (its choices aborted)."""
        upds: list[list[Update]] = [[] for _ in range(choices.n)]
        try:
            async for item in choices.updates(timeout=0.5):
                if item is None:
                    if await request.is_disconnected():
                        choices.abort()
                        return None
                    continue
                i, u = item
                upds[i].append(u)
                if u.error:
                    choices.abort()
                    raise _engine_error(u)
            return upds
        except asyncio.CancelledError:
            choices.abort()
            raise

    async def _stream(choices: ChoiceBatch, replies: list[Reply], include_usage: bool) -> AsyncIterator[str]:
        chat = replies[0].chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": choices.request_id, "object": obj, "created": int(time.time()), "model": name}

        def chunk(choice: dict, usage: dict | None = None, extra: dict | None = None) -> str:
            d = dict(base, choices=[choice] if choice else [], **(extra or {}))
            if include_usage:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        def piece(i: int, text: str, lp: dict | None, reason: str | None) -> dict:
            if chat:
                return {"index": i, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": reason}
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

        finished = False
        lasts: dict[int, Update] = {}
        led: set[int] = set()
        tools = replies[0].tools
        parsers = [StreamParser(tools) for _ in range(choices.n)] if tools is not None else None
        try:
            if chat:
                for i in range(choices.n):
                    yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})
            try:
                async for i, u in choices.updates():
                    if u.error:
                        choices.abort()
                        yield f"data: {json.dumps(_engine_error(u).body())}\n\n"
                        break
                    k, j = choices.part_of(i)
                    reply = replies[k]
                    reply.see(j, u)
                    if i not in led:  # the echo, and the prompt's logprobs, before a choice's first tokens
                        led.add(i)
                        text, lp = reply.lead()
                        prompt_lp = reply.prompt_field() if j == 0 else None
                        if text or lp or prompt_lp is not None:
                            c = piece(i, text, lp, None)
                            extra = None
                            if prompt_lp is not None:
                                if chat:
                                    extra = {"prompt_logprobs": prompt_lp}
                                else:
                                    c["prompt_logprobs"] = prompt_lp
                            yield chunk(c, extra=extra)
                    if reply.prompt_only:
                        if u.finished:
                            yield chunk(piece(i, "", None, u.finish_reason))
                    elif parsers is not None:
                        for c in reply.tool_chunks(parsers[i], i, u):
                            yield chunk(c)
                    elif u.text or u.token_ids or u.finished:
                        lp = None
                        if reply.want_lp and u.token_ids:
                            lp = logprobs.chat([u]) if chat else logprobs.completion([u])
                        yield chunk(piece(i, u.text, lp, u.finish_reason if u.finished else None))
                    if u.finished:
                        lasts[i] = u
            except P.APIError as e:  # a later choice was refused (queue full, shutdown)
                yield f"data: {json.dumps(e.body())}\n\n"
            finished = True
            if include_usage and len(lasts) == choices.n:
                usage = total_usage([lasts[i] for i in range(choices.n)], choices.starts, replies[0].prompt_only)
                yield chunk({}, usage)
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream
                choices.abort()

    async def _respond(request: Request, prompts: list[tuple[list[int], str]], req: inputs.GenerationRequest,
                       chat: bool, asked_prompt_lp: bool = False, tools: ToolPlan | None = None):
        """`prompts`: (token ids, the text that leads each of its choices' replies: the
        request's `echo`); asked_prompt_lp: the request's own prompt_logprobs (not only
        echo's need of them); tools: the request's tool plan (chat)."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        parts: list[Choices] = []
        try:
            for k, (ids, _) in enumerate(prompts):
                parts.append(await _start(ids, req, chat, rid if len(prompts) == 1 else f"{rid}-p{k}"))
        except BaseException:
            for c in parts:  # a later prompt refused: nothing of the request runs on
                c.abort()
            raise
        choices = ChoiceBatch(parts, rid)
        replies = [Reply(logprobs, ids, req, chat, echo, asked_prompt_lp, tools) for ids, echo in prompts]
        if req.stream:
            return StreamingResponse(_stream(choices, replies, req.include_usage), media_type="text/event-stream")
        per_choice = await _collect(request, choices)
        if per_choice is None:
            return Response(status_code=499)  # the client is gone
        for k, start in enumerate(choices.starts):
            for u in per_choice[start]:
                replies[k].see(0, u)
        out = []
        for i in choices.returned(per_choice):
            upds, reply = per_choice[i], replies[choices.part_of(i)[0]]
            lead, lead_lp = reply.lead()
            text, lp = reply.body(upds)
            if lead_lp is not None:
                lp = joined(lead_lp, lp)
            reason = upds[-1].finish_reason
            if chat:
                msg, reason = reply.message(text, reason)
                if lead:
                    msg["content"] = lead + (msg["content"] or "")
                choice = {"index": len(out), "message": msg, "logprobs": lp}
            else:
                choice = {"index": len(out), "text": lead + text, "logprobs": lp}
                if asked_prompt_lp:
                    choice["prompt_logprobs"] = reply.prompt_field()
            choice["finish_reason"] = reason
            out.append(choice)
        body = {"id": choices.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": name, "choices": out,
                "usage": total_usage([u[-1] for u in per_choice], choices.starts, req.prompt_only)}
        if chat and asked_prompt_lp:
            body["prompt_logprobs"] = replies[0].prompt_field()
        return body

    @api.post("/v1/completions", response_model=None,
              responses={200: {"model": P.CompletionResponse,
                               "description": "JSON, or server-sent events ending with data: [DONE]"}})
    async def completions(req: P.CompletionRequest, request: Request):
        gen = inputs.generation(req, chat=False, default_max_tokens=16)
        _check_model(gen)
        prompts = []
        for prompt in inputs.completion_prompts(req):
            ids = prompt
            if req.suffix is not None:  # fill in the middle: the prompt is what comes before
                if not isinstance(prompt, str):
                    raise P.bad("suffix needs the prompt as text", "suffix")
                _refuse_long_text(len(prompt) + len(req.suffix), "prompt")
                try:
                    ids = await asyncio.to_thread(tok.fill_in_the_middle, prompt, req.suffix)
                except ValueError as e:
                    raise P.bad(str(e), "suffix") from None
            elif isinstance(prompt, str):
                _refuse_long_text(len(prompt), "prompt")
                ids = await asyncio.to_thread(tok.encode, prompt)
            kept = _truncated(ids, gen.truncate_prompt_tokens)
            echo = ""
            if gen.echo:  # the prompt as sent, or as decoded where it was token ids or was truncated
                same = isinstance(prompt, str) and len(kept) == len(ids)
                echo = prompt if same else tok.decode(kept, skip_special_tokens=gen.params.skip_special_tokens)
            prompts.append((kept, echo))
        return await _respond(request, prompts, gen, chat=False, asked_prompt_lp=req.prompt_logprobs is not None)

    @api.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": P.ChatCompletionResponse,
                               "description": "JSON, or server-sent events ending with data: [DONE]"}})
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        gen = inputs.generation(req, chat=True, default_max_tokens=None)
        _check_model(gen)
        tools = inputs.tool_plan(req, tok.chat_template)
        if tools is not None and tools.schema is not None:
            gen.params.structured_outputs = inputs.tool_constraint(tools)
        if tools is not None and tools.mode == "auto":
            # The call tags may be special tokens (Qwen2.5's GGUF): kept in the text to be parsed.
            gen.params.skip_special_tokens = False
        ids = _truncated(await _chat_ids(req.messages, inputs.chat_options(req, tools)), gen.truncate_prompt_tokens)
        return await _respond(request, [(ids, inputs.chat_echo(req))], gen, chat=True,
                              asked_prompt_lp=req.prompt_logprobs is not None, tools=tools)

    app.include_router(api)
    return app


def _engine_error(u: Update) -> P.APIError:
    if u.error_status == 503:
        return P.APIError(503, u.error, None, u.error_code or "shutting_down")
    if u.error_status == 400:  # the request's own doing, found while it ran
        return P.APIError(400, u.error, None, u.error_code or "invalid_request")
    return P.APIError(500, u.error, None, u.error_code or "engine_error", "server_error")


def serve(engine: LLMEngine, host: str, port: int, max_queue: int | None,
          served_model_name: str | None = None, api_key: str | None = None,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, shutdown_timeout: float = 30.0) -> None:
    """Serve until SIGTERM/SIGINT; then stop admitting, let running requests finish within
    `shutdown_timeout` seconds, abort the rest (their KV freed) and return."""
    app = create_app(engine, served_model_name, max_queue, api_key, max_request_bytes)
    print(f"headwise serving {served_model_name or engine.model_name} on http://{host}:{port} "
          f"(layout {engine.layout.name}: {engine.layout.summary}"
          f"{', API key required' if api_key else ''})", flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=int(shutdown_timeout) + 5)
    GracefulServer(config, app.state.engine, shutdown_timeout).run()
    used = sum(u["used_bytes"] for u in engine.stats().usage.values())
    print(f"headwise stopped; KV bytes in use: {used}", flush=True)


__all__: list[Any] = ["create_app", "serve"]
