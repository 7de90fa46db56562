"""Per-request state: tokens, progress, outputs, timings."""
from __future__ import annotations

import enum
import itertools
import time

import torch

from headwise.sampling import SamplingParams

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str | None = None) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = SeqStatus.WAITING
        # Tokens whose K/V are in the cache; catches up with num_tokens (chunked prefill
        # and decode are the same thing). Reset to 0 on preemption (recompute).
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when first scheduled (None: not yet).
        self.num_cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None  # why the request failed (finish_reason "abort"), if it did
        self.error_code: str | None = None  # the server's code for it (None: structured_output_failed)
        # params.bad_words as token ids (engine.sampler.bad_word_ids), made on admission
        self.bad_word_ids: list[list[int]] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        # With params.prompt_logprobs: entry p is {prompt token p: its logprob given the
        # tokens before it} plus the top k there; entry 0 stays None (nothing precedes it).
        # prompt_ranks[p]: that token's rank there (1: the most likely).
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_ranks: list[int | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            self.prompt_ranks = [None] * len(self.prompt_token_ids)
        self.output_text = ""
        self.detokenizer = None  # an IncrementalDetokenizer, made by the engine on the first token
        # An llguidance matcher when the request asks for structured outputs (engine/grammar.py).
        self.matcher = None
        self._prompt_tensor: torch.Tensor | None = None
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        # time.perf_counter() stamps: arrival, first token, every token, finish.
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def prompt_ids_tensor(self) -> torch.Tensor:
        """The prompt's ids as a tensor [P] (made once; the repetition penalty reads it every step)."""
        if self._prompt_tensor is None:
            self._prompt_tensor = torch.tensor(self.prompt_token_ids, dtype=torch.long)
        return self._prompt_tensor

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time
