"""A request's n choices as one stream of (choice index, Update).

Choice 0 is submitted first; the others once its first update arrives (its prompt is then
prefilled and in the prefix cache), so they reuse the prompt's KV instead of computing
it again. Works over any EngineClient: each choice is an ordinary request with its own
seed (SamplingParams.for_choice).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

from headwise.sampling import SamplingParams
from headwise.server.engine_client import EngineClient, RequestStream, Update

Submit = Callable[[SamplingParams, str], Awaitable[RequestStream]]


class Choices:
    def __init__(self, engine: EngineClient, submit: Submit, params: SamplingParams, request_id: str) -> None:
        self.engine = engine
        self.submit = submit        # (params, request id) -> stream; raises APIError when refused
        self.params = params
        self.request_id = request_id
        self.n = params.n
        self.streams: list[RequestStream] = []
        self._merged: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._open = 0              # choices not finished yet
        self._finished: set[int] = set()

    async def start(self) -> None:
        """Submit choice 0 (raises what `submit` raises; nothing is left running then)."""
        await self._add(0)

    async def _add(self, i: int) -> None:
        rid = self.request_id if self.n == 1 else f"{self.request_id}-{i}"
        stream = await self.submit(self.params.for_choice(i), rid)
        self.streams.append(stream)
        self._open += 1
        self._pumps.append(asyncio.create_task(self._pump(i, stream)))

    async def _pump(self, i: int, stream: RequestStream) -> None:
        while True:
            u = await stream.queue.get()
            await self._merged.put((i, u))
            if u.finished:
                return

    async def updates(self, timeout: float | None = None) -> AsyncIterator[tuple[int, Update] | None]:
        """Every choice's updates as they come; None after `timeout` seconds without one
        (the caller checks its client is still there). Raises what `submit` raises when a
        later choice is refused; the choices already running are aborted then."""
        while self._open:
            try:
                i, u = await asyncio.wait_for(self._merged.get(), timeout)
            except asyncio.TimeoutError:
                yield None
                continue
            if i == 0 and len(self.streams) == 1 and self.n > 1:
                try:
                    for j in range(1, self.n):
                        await self._add(j)
                except BaseException:
                    self.abort()
                    raise
            if u.finished:
                self._open -= 1
                self._finished.add(i)
            yield i, u

    def abort(self) -> None:
        """The client went away or a choice failed: stop every unfinished choice, freeing its KV."""
        for i, s in enumerate(self.streams):
            if i not in self._finished:
                self.engine.abort(s)
        for t in self._pumps:
            t.cancel()
        self._open = 0
