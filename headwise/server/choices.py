"""A request's n choices as one stream of (choice index, Update).

Choice 0 is submitted first; the others once its first update arrives (its prompt is then
prefilled and in the prefix cache), so they reuse the prompt's KV instead of computing
it again. Works over any EngineClient: each choice is an ordinary request with its own
seed (SamplingParams.for_choice).
"""
from __future__ import annotations

import asyncio
import math
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
        self.n = params.choices     # streams: best_of of them where given (the best n returned)
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


class ChoiceBatch:
    """Several prompts' Choices (a completions request with a list of prompts) as one
    stream of (index, Update): prompt k's choice j has index k * n + j, as in OpenAI's and
    vLLM's responses (with best_of > n, k * best_of + j, until the best are chosen)."""

    def __init__(self, parts: list[Choices], request_id: str) -> None:
        self.parts = parts
        self.request_id = request_id
        self.n = sum(p.n for p in parts)
        self.starts = [sum(p.n for p in parts[:k]) for k in range(len(parts))]

    def returned(self, per_choice: list[list[Update]]) -> list[int]:
        """The indices of the choices a finished request returns, in order: every one, or
        per prompt the best n by cumulative logprob where best_of > n."""
        out = []
        for part, start in zip(self.parts, self.starts):
            cumulative = [math.fsum(lp for u in per_choice[start + j] for lp in u.logprobs) for j in range(part.n)]
            out += [start + j for j in part.params.best(cumulative)]
        return out

    def part_of(self, i: int) -> tuple[int, int]:
        """(prompt, its choice) of index i."""
        k = max(k for k, s in enumerate(self.starts) if s <= i)
        return k, i - self.starts[k]

    async def updates(self, timeout: float | None = None) -> AsyncIterator[tuple[int, Update] | None]:
        """As Choices.updates, over every prompt's choices."""
        if len(self.parts) == 1:
            async for item in self.parts[0].updates(timeout):
                yield item
            return
        merged: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(k: int, part: Choices) -> None:
            try:
                async for item in part.updates():
                    await merged.put((k, item))
            except Exception as e:  # a later choice refused: raised to the reader
                await merged.put((k, e))
            await merged.put((k, done))

        pumps = [asyncio.create_task(pump(k, p)) for k, p in enumerate(self.parts)]
        open_parts = len(self.parts)
        try:
            while open_parts:
                try:
                    k, item = await asyncio.wait_for(merged.get(), timeout)
                except asyncio.TimeoutError:
                    yield None
                    continue
                if item is done:
                    open_parts -= 1
                elif isinstance(item, Exception):
                    self.abort()
                    raise item
                else:
                    i, u = item
                    yield self.starts[k] + i, u
        finally:
            for t in pumps:
                t.cancel()

    def abort(self) -> None:
        for p in self.parts:
            p.abort()
