"""`headwise serve`: OpenAI-compatible HTTP API over the async engine (FastAPI)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from headwise.engine.llm_engine import LLMEngine, PromptTooLongError
from headwise.engine.scheduler import QueueFullError
from headwise.server import protocol as P
from headwise.server.async_engine import AsyncEngine, Update


def _error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(engine: LLMEngine, served_model_name: str | None = None,
               max_queue: int | None = None) -> FastAPI:
    aeng = AsyncEngine(engine, max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        aeng.shutdown()

    app = FastAPI(title="headwise", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.engine = aeng
    name = served_model_name or engine.model_name
    created = int(time.time())
    tok = engine.tokenizer

    @app.exception_handler(P.APIError)
    async def _api_error(_: Request, e: P.APIError):
        return _error(e)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        err = P.APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error",
                         type_="server_error")
        return _error(err)

    @app.get("/health")
    async def health():
        if not aeng.alive:
            return JSONResponse({"status": "dead"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        aeng._publish_state()
        return Response(aeng.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                             "owned_by": "headwise", "max_model_len": engine.max_model_len}]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget every cached prefix (running requests keep their KV)."""
        pages = await aeng.reset_prefix_cache()
        return {"status": "ok", "pages_freed": pages}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = P.parse_json_object(await request.body())
        if "messages" in body:
            ids = await asyncio.to_thread(tok.encode_chat, P.chat_messages(body))
        elif isinstance(body.get("prompt"), str):
            special = body.get("add_special_tokens", True)
            ids = await asyncio.to_thread(tok.encode, body["prompt"], bool(special))
        else:
            raise P.bad("give prompt (a string) or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = P.parse_json_object(await request.body())
        ids = body.get("tokens")
        vocab = engine.model_config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise P.bad(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}

    def _check_model(req: P.GenerationRequest) -> None:
        if req.model is not None and req.model != name:
            raise P.APIError(400, f"the model {req.model!r} does not exist; this server serves {name!r}",
                             "model", "model_not_found")

    async def _submit(ids: list[int], req: P.GenerationRequest, chat: bool):
        if chat and not req.max_tokens_given:
            req.params.max_tokens = max(1, engine.max_model_len - len(ids))
        try:
            engine.check_length(len(ids), req.params.max_tokens)
            ids = engine.encode(ids)
            cap = engine.cache.max_tokens_per_seq()
            if len(ids) + req.params.max_tokens > cap:
                raise PromptTooLongError(
                    f"the request needs KV for {len(ids)} + {req.params.max_tokens} tokens but the KV cache "
                    f"holds at most {cap} tokens per sequence")
        except PromptTooLongError as e:
            raise P.APIError(400, str(e), "max_tokens" if len(ids) else "prompt", "context_length_exceeded") from None
        except ValueError as e:
            raise P.bad(str(e), "prompt") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            return rid, aeng.submit(ids, req.params, rid)
        except QueueFullError as e:
            raise P.APIError(503, str(e), None, "queue_full") from None

    def _usage(u: Update) -> dict:
        return {"prompt_tokens": u.num_prompt_tokens, "completion_tokens": u.num_output_tokens,
                "total_tokens": u.num_prompt_tokens + u.num_output_tokens,
                "prompt_tokens_details": {"cached_tokens": u.num_cached_tokens}}

    def _completion_logprobs(upds: list[Update]) -> dict:
        toks, lps, tops = [], [], []
        for u in upds:
            toks += [tok.decode([t], skip_special_tokens=False) for t in u.token_ids]
            lps += u.logprobs
            tops += [{tok.decode([k], skip_special_tokens=False): v for k, v in d.items()} for d in u.top_logprobs]
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops or None, "text_offset": None}

    def _chat_logprobs(upds: list[Update]) -> dict:
        content = []
        for u in upds:
            for i, t in enumerate(u.token_ids):
                s = tok.decode([t], skip_special_tokens=False)
                top = u.top_logprobs[i] if i < len(u.top_logprobs) else {}
                content.append({"token": s, "logprob": u.logprobs[i], "bytes": list(s.encode()),
                                "top_logprobs": [{"token": tok.decode([k], skip_special_tokens=False),
                                                  "logprob": v, "bytes": list(tok.decode([k]).encode())}
                                                 for k, v in top.items()]})
        return {"content": content}

    async def _collect(request: Request, handle) -> list[Update]:
        upds = []
        try:
            while True:
                try:
                    u = await asyncio.wait_for(handle.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        aeng.abort(handle)
                        return upds
                    continue
                upds.append(u)
                if u.finished:
                    return upds
        except asyncio.CancelledError:
            aeng.abort(handle)
            raise

    def _final(upds: list[Update]) -> Update:
        last = upds[-1]
        if last.error:
            raise P.APIError(500, last.error, None, "engine_error", "server_error")
        return last

    async def _stream(handle, rid: str, chat: bool, include_usage: bool, want_lp: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": int(time.time()), "model": name}

        def chunk(choice: dict, usage: dict | None = None) -> str:
            d = dict(base, choices=[choice] if choice else [])
            if include_usage:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            while True:
                u = await handle.queue.get()
                if u.error:
                    finished = True
                    yield f"data: {json.dumps(P.APIError(500, u.error, None, 'engine_error', 'server_error').body())}\n\n"
                    break
                if u.text or u.token_ids or u.finished:
                    lp = None
                    if want_lp and u.token_ids:
                        lp = _chat_logprobs([u]) if chat else _completion_logprobs([u])
                    reason = u.finish_reason if u.finished else None
                    if chat:
                        delta = {"content": u.text} if u.text else {}
                        yield chunk({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason})
                    else:
                        yield chunk({"index": 0, "text": u.text, "logprobs": lp, "finish_reason": reason})
                if u.finished:
                    finished = True
                    if include_usage:
                        yield chunk({}, _usage(u))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream
                aeng.abort(handle)

    async def _respond(request: Request, ids: list[int], req: P.GenerationRequest, chat: bool):
        rid, handle = await _submit(ids, req, chat=chat)
        want_lp = req.params.logprobs is not None
        if req.stream:
            return StreamingResponse(_stream(handle, rid, chat, req.include_usage, want_lp),
                                     media_type="text/event-stream")
        upds = await _collect(request, handle)
        if not upds:
            return Response(status_code=499)  # the client is gone
        last = _final(upds)
        text = "".join(u.text for u in upds)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": _chat_logprobs(upds) if want_lp else None}
        else:
            choice = {"index": 0, "text": text, "logprobs": _completion_logprobs(upds) if want_lp else None}
        choice["finish_reason"] = last.finish_reason
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": name, "choices": [choice], "usage": _usage(last)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = P.parse_json_object(await request.body())
        req = P.sampling_from(body, chat=False, default_max_tokens=16)
        _check_model(req)
        prompt = P.completion_prompt(body)
        ids = await asyncio.to_thread(tok.encode, prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise P.bad("the prompt is empty", "prompt")
        return await _respond(request, ids, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = P.parse_json_object(await request.body())
        req = P.sampling_from(body, chat=True, default_max_tokens=None)
        _check_model(req)
        msgs = P.chat_messages(body)
        try:
            ids = await asyncio.to_thread(tok.encode_chat, msgs)
        except ValueError as e:
            raise P.bad(str(e), "messages") from None
        return await _respond(request, ids, req, chat=True)

    return app


def serve(engine: LLMEngine, host: str, port: int, max_queue: int | None,
          served_model_name: str | None = None) -> None:
    import uvicorn

    app = create_app(engine, served_model_name, max_queue)
    print(f"headwise serving {served_model_name or engine.model_name} on http://{host}:{port} "
          f"(layout {engine.layout.name}, {engine.layout.full_fraction:.0%} full heads)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


__all__: list[Any] = ["create_app", "serve"]
