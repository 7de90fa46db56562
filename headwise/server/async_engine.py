"""Runs the LLMEngine on its own thread and bridges it to asyncio.

HTTP handlers never touch the engine directly: they submit commands (add, abort) to a
queue the engine thread drains between steps, and read their request's stream of
updates from an asyncio.Queue fed with call_soon_threadsafe. The event loop therefore
stays responsive (health checks, other streams) during a long prefill.
"""
from __future__ import annotations

import asyncio
import queue
import threading

from headwise.engine.llm_engine import LLMEngine
from headwise.engine.scheduler import QueueFullError
from headwise.engine.sequence import Sequence
from headwise.sampling import SamplingParams
from headwise.server.engine_client import (EngineClient, RequestStream, ServedModel, ShuttingDownError,
                                           Update)
from headwise.server.metrics import Metrics


class _Handle(RequestStream):
    def __init__(self, seq: Sequence, loop: asyncio.AbstractEventLoop) -> None:
        self.seq = seq
        self.loop = loop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.sent_text = 0
        self.sent_tokens = 0
        self.sent_prompt = False  # its prompt's logprobs (prompt_logprobs), sent with the first tokens
        # Text that might be the start of a stop string is held back until it is not.
        self.holdback = max((len(s) for s in seq.params.stop), default=1) - 1


class AsyncEngine(EngineClient):
    def __init__(self, engine: LLMEngine, max_queue: int | None = None) -> None:
        self.engine = engine
        self.model = ServedModel.of(engine)
        self.max_queue = max_queue
        self.metrics = Metrics(engine.model_name)
        self.metrics.set_kv_format(engine.stats().kv_formats)
        self._commands: queue.Queue = queue.Queue()
        self._handles: dict[int, _Handle] = {}
        self._wake = threading.Event()
        self._stop = False
        self._pending_adds = 0
        self.alive = True
        self.draining = False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="headwise-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop -----------------------------------------------
    def num_waiting(self, stats=None) -> int:
        """Requests queued in the engine and on their way to it (stats: the engine's, if read)."""
        return (stats or self.engine.stats()).num_waiting + self._pending_adds

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> _Handle:
        """Queue a validated request; raises QueueFullError when the waiting queue is full."""
        if self.draining:
            raise ShuttingDownError("the server is shutting down; retry on another replica or later")
        if self.max_queue is not None and self.num_waiting() >= self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests); retry later")
        if params.structured_outputs is None:
            seq = self.engine.new_sequence(prompt_ids, params, request_id)
        else:  # compiling the constraint may take a while: not on the loop, nor the engine thread
            seq = await asyncio.to_thread(self.engine.new_sequence, prompt_ids, params, request_id)
        handle = _Handle(seq, asyncio.get_running_loop())
        self._pending_adds += 1
        self._commands.put(("add", handle))
        self._wake.set()
        return handle

    def abort(self, handle: _Handle) -> None:
        self._commands.put(("abort", handle))
        self._wake.set()

    def drain(self, timeout: float) -> None:
        """Admit nothing more; abort what is still running after `timeout` seconds."""
        self.draining = True

        def expire() -> None:
            self._commands.put(("fail_all", None))
            self._wake.set()

        timer = threading.Timer(timeout, expire)
        timer.daemon = True
        timer.start()

    async def reset_prefix_cache(self) -> int:
        """Run on the engine thread between steps (it owns the cache books)."""
        done = asyncio.get_running_loop().create_future()
        self._commands.put(("reset", done))
        self._wake.set()
        return await done

    async def health(self) -> tuple[bool, dict]:
        return self.alive, {"status": "ok" if self.alive else "dead"}

    async def metrics_text(self) -> str:
        self._publish_state()
        return self.metrics.render().decode()

    def shutdown(self) -> None:
        """Stop the engine thread (the engine itself stays usable)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    def close(self) -> None:
        self.shutdown()
        self.engine.close()  # cached prefixes to the KV offload directory, if there is one

    # ---- engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            self._drain_commands()
            if not eng.has_unfinished():
                self._publish_state()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            before = eng.scheduler.num_preemptions
            try:
                updated = eng.step()
            except Exception as e:  # a bug, not bad input: fail the batch, keep serving
                self._fail_all(f"internal engine error: {type(e).__name__}: {e}")
                continue
            self.steps += 1
            if eng.scheduler.num_preemptions > before:
                self.metrics.preemptions.labels(self.metrics.model).inc(eng.scheduler.num_preemptions - before)
            for seq in updated:
                h = self._handles.get(seq.seq_id)
                if h is not None:
                    self._emit(h)
            self._publish_state()
        self.alive = False

    def _drain_commands(self) -> None:
        while True:
            try:
                op, h = self._commands.get_nowait()
            except queue.Empty:
                return
            if op == "fail_all":
                self._fail_all("the server is shutting down; the request was aborted", 503)
            elif op == "reset":
                pages = self.engine.reset_prefix_cache()
                h.get_loop().call_soon_threadsafe(h.set_result, pages)
            elif op == "add":
                self._pending_adds -= 1
                if h.seq.is_finished:  # aborted before it was added
                    continue
                try:
                    self.engine.add_sequence(h.seq)
                except Exception as e:
                    self._push(h, Update("", [], [], [], True, "abort", error=str(e)))
                    continue
                self._handles[h.seq.seq_id] = h
            elif op == "abort":
                seq = h.seq
                if not seq.is_finished:
                    self.engine.abort(seq)  # frees its KV now
                    self.metrics.on_finished(seq)
                self._handles.pop(seq.seq_id, None)

    def _emit(self, h: _Handle) -> None:
        seq = h.seq
        done = seq.is_finished
        text = seq.output_text
        end = len(text) if done else max(h.sent_text, len(text) - h.holdback)
        n_tok = len(seq.output_token_ids)
        lp = seq.logprobs[h.sent_tokens:n_tok] if seq.params.logprobs is not None else []
        top = seq.top_logprobs[h.sent_tokens:n_tok] if seq.params.logprobs else []
        upd = Update(text[h.sent_text:end], seq.output_token_ids[h.sent_tokens:n_tok], lp, top, done,
                     seq.finish_reason, seq.error, seq.num_prompt_tokens, n_tok, seq.num_cached_tokens or 0,
                     error_status=400, error_code=seq.error_code or "structured_output_failed")
        if not h.sent_prompt and seq.prompt_logprobs is not None and (n_tok or done):
            upd.prompt_logprobs, upd.prompt_ranks = list(seq.prompt_logprobs), list(seq.prompt_ranks)
            h.sent_prompt = True
        h.sent_text, h.sent_tokens = end, n_tok
        self._push(h, upd)
        if done:
            self.metrics.on_finished(seq)
            self._handles.pop(seq.seq_id, None)

    def _fail_all(self, message: str, status: int = 500) -> None:
        for h in list(self._handles.values()):
            if not h.seq.is_finished:
                self.engine.abort(h.seq)
                self.metrics.on_finished(h.seq)
            self._push(h, Update("", [], [], [], True, "abort", error=message, error_status=status))
        self._handles.clear()

    def _push(self, h: _Handle, upd: Update) -> None:
        try:
            h.loop.call_soon_threadsafe(h.queue.put_nowait, upd)
        except RuntimeError:
            pass  # the event loop is gone (shutdown)

    def _publish_state(self) -> None:
        stats = self.engine.stats()
        self.metrics.update_state(stats, self.num_waiting(stats))
