"""What the HTTP app needs from an engine: the one interface behind `create_app`.

Two implementations: `AsyncEngine` (the engine on a thread of this process, `headwise
serve`) and `RayEngineClient` (engine replicas behind a Ray Serve deployment handle,
`headwise serve --replicas N`). The app validates and tokenizes requests itself, from a
`ServedModel`, and only hands the engine token ids; so the protocol is implemented once.
"""
from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass
from typing import Any

from headwise.engine.llm_engine import LLMEngine
from headwise.engine.request_checks import PromptTooLongError, check_length, check_token_ids
from headwise.sampling import SamplingParams
from headwise.tokenizer import Tokenizer


@dataclass
class Update:
    """One step's news for one request, as the app streams it."""
    text: str                      # new text since the last update
    token_ids: list[int]           # new token ids
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error_status: int = 500        # 503: the request was not the problem (shutdown, a lost replica)
    error_code: str | None = None  # the OpenAI envelope's `code`; None: derived from the status
    # With prompt_logprobs, on a request's first update: Sequence.prompt_logprobs / prompt_ranks.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None


class ShuttingDownError(RuntimeError):
    pass


class EngineUnavailableError(RuntimeError):
    """No engine could take the request (e.g. its Ray replica was lost): 503, retry."""


@dataclass(frozen=True)
class ServedModel:
    """The model as the HTTP layer sees it. Picklable: a Ray ingress receives it from a replica."""
    name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    max_kv_tokens_per_seq: int     # what the KV pools can hold for one sequence
    layout: str
    full_fraction: float           # share of KV heads that are full heads

    @classmethod
    def of(cls, engine: LLMEngine) -> ServedModel:
        return cls(engine.model_name, engine.tokenizer, engine.model_config.vocab_size, engine.max_model_len,
                   engine.max_kv_tokens_per_seq, engine.layout.name, engine.layout.full_fraction)

    def check(self, ids: list[int], max_tokens: int) -> list[int]:
        """The ids, checked against the vocabulary, the context and the KV cache; raises
        PromptTooLongError or ValueError."""
        check_length(len(ids), max_tokens, self.max_model_len)
        ids = check_token_ids(ids, self.vocab_size)
        if len(ids) + max_tokens > self.max_kv_tokens_per_seq:
            raise PromptTooLongError(
                f"the request needs KV for {len(ids)} + {max_tokens} tokens but the KV cache "
                f"holds at most {self.max_kv_tokens_per_seq} tokens per sequence")
        return ids


class RequestStream(abc.ABC):
    """One submitted request: its updates arrive on `queue`; the last has finished=True."""
    queue: asyncio.Queue[Update]


class EngineClient(abc.ABC):
    model: ServedModel

    @abc.abstractmethod
    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue checked ids. Raises QueueFullError or ShuttingDownError when not admitted."""

    @abc.abstractmethod
    def abort(self, stream: RequestStream) -> None:
        """The client went away: stop the request and free its KV."""

    @abc.abstractmethod
    async def health(self) -> tuple[bool, dict[str, Any]]:
        """(serving, body of /health)."""

    @abc.abstractmethod
    async def metrics_text(self) -> str:
        """Prometheus text exposition of the engine's (or every replica's) metrics."""

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; the number of pages freed."""

    def drain(self, timeout: float) -> None:
        """Admit nothing more; abort what still runs after `timeout` seconds (SIGTERM)."""

    def close(self) -> None:
        """The app is stopping."""
