"""What stands between the network and the engine: API keys, a bound on request bodies,
the early refusal of prompts that cannot fit, and a graceful stop on SIGTERM/SIGINT."""
from __future__ import annotations

import contextlib
import hmac
import json
import signal
import threading

import uvicorn
from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from headwise.server.protocol import APIError

API_KEY_ENV = "HEADWISE_API_KEY"


def api_key_dependency(api_key: str | None):
    """A FastAPI dependency requiring `Authorization: Bearer <api_key>` (none if None).
    Compared in constant time; a missing or wrong key answers 401 in the envelope."""
    bearer = HTTPBearer(auto_error=False, description="the server's --api-key")
    want = api_key.encode() if api_key else None

    async def check(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if want is None:
            return
        got = cred.credentials.encode() if cred is not None else b""
        if not hmac.compare_digest(got, want):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           None, "invalid_api_key", "authentication_error")

    return check


class GuardMiddleware:
    """Pure ASGI middleware: refuses bodies over `max_bytes` with 413 (by Content-Length
    before reading; a chunked body is read here, up to the bound, and replayed), and
    turns any exception that escapes the app into a 500 in the envelope without dropping
    the connection."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                return await _send_error(send, _too_large(self.max_bytes))
        elif scope["method"] in ("POST", "PUT", "PATCH"):
            body, more = b"", True
            while more:
                msg = await receive()
                if msg["type"] != "http.request":
                    return  # the client went away
                body += msg.get("body", b"")
                more = msg.get("more_body", False)
                if len(body) > self.max_bytes:
                    return await _send_error(send, _too_large(self.max_bytes))
            receive = _replay(body, receive)
        started = False

        async def tracking_send(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # a genuine fault: answer it, keep serving the connection
            if not started:
                await _send_error(send, APIError(500, f"internal error: {type(e).__name__}: {e}",
                                                 None, "internal_error", "server_error"))


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later: a disconnect

    return replay


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than this server accepts ({limit} bytes)",
                    None, "request_too_large")


async def _send_error(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for (its longest vocabulary entry; a
    byte-level entry spells each byte with one character): a text of n characters
    needs at least n / this many tokens, so longer ones are refused before tokenizing."""
    return max(len(t) for t in tokenizer.hf.get_vocab())


class GracefulServer(uvicorn.Server):
    """uvicorn, plus: the first SIGTERM/SIGINT stops admitting requests and gives running
    ones `timeout` seconds before they are aborted with an error event (their KV freed);
    the process then exits normally (uvicorn would re-raise the signal)."""

    def __init__(self, config: uvicorn.Config, engine, timeout: float) -> None:
        super().__init__(config)
        self.engine, self.timeout = engine, timeout

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.engine.drain(self.timeout)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in originals.items():
                signal.signal(s, h)
