"""Offline API: LLM(model).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

from dataclasses import dataclass

from headwise.config import EngineConfig
from headwise.engine.llm_engine import LLMEngine
from headwise.engine.sequence import Sequence
from headwise.sampling import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    ttft_s: float | None
    latency_s: float | None
    num_preemptions: int
    num_cached_tokens: int          # prompt tokens served from the prefix cache

    @classmethod
    def from_seq(cls, seq: Sequence) -> "RequestOutput":
        has_lp = seq.params.logprobs is not None
        return cls(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.output_text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if has_lp else None,
            top_logprobs=list(seq.top_logprobs) if has_lp and seq.params.logprobs else None,
            ttft_s=seq.ttft_s,
            latency_s=seq.latency_s,
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )


class LLM:
    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model, engine_options))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_model(cls, model, tokenizer, **engine_options) -> "LLM":
        """An LLM over an already built CausalLM (on the engine's device and dtype) and a
        tokenizer; the engine reorders the model's heads for its layout, so pass a model
        to one LLM only."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(EngineConfig.from_options(None, engine_options), loaded=(model, tokenizer))
        llm.tokenizer = tokenizer
        return llm

    def generate(self, prompts: "str | list[int] | list[str | list[int]]",
                 params: "SamplingParams | list[SamplingParams] | None" = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """`params`: one SamplingParams for every prompt, or one per prompt (as vLLM takes)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts; "
                                 "pass one, or one per prompt")
            per_prompt = params
        else:
            per_prompt = [params or SamplingParams()] * len(prompts)
        # Validate every prompt before any is queued, so bad input leaves nothing behind.
        encoded = [self.engine.encode(p) for p in prompts]
        for ids, p in zip(encoded, per_prompt):
            self.engine.check_length(len(ids), p.max_tokens)
        seqs: list[Sequence] = []
        try:
            for ids, p in zip(encoded, per_prompt):
                seqs.append(self.engine.add_request(ids, p))
            self._run(seqs, use_tqdm and len(seqs) > 1)
        except BaseException:
            for s in seqs:
                if not s.is_finished:
                    self.engine.abort(s)
            raise
        return [RequestOutput.from_seq(s) for s in seqs]

    def chat(self, messages, params: "SamplingParams | list[SamplingParams] | None" = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """`messages`: one conversation (a list of {role, content}) or a list of them;
        `params` as in generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c) for c in convs]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, seqs: list[Sequence], progress: bool) -> None:
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(seqs), desc="generating", unit="req")
        done = 0
        while self.engine.has_unfinished():
            self.engine.step()
            if bar is not None:
                now = sum(s.is_finished for s in seqs)
                bar.update(now - done)
                done = now
        if bar is not None:
            bar.close()

    def kv_bytes(self, num_tokens: int) -> int:
        """KV bytes one sequence of `num_tokens` tokens occupies under the current layout."""
        return self.engine.kv_bytes(num_tokens)

    def cache_usage(self) -> dict[str, dict[str, float]]:
        return self.engine.cache.usage()

    def offload_prefix_cache(self) -> None:
        """Copy cached prefixes to the KV offload directory (if one is set) and wait."""
        self.engine.offload_prefix_cache()

    def close(self) -> None:
        """Offload cached prefixes (if a KV offload directory is set); the LLM stays usable
        without its disk tier afterwards only if none was set."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the number of pages that held one."""
        return self.engine.reset_prefix_cache()

    @property
    def layout(self):
        return self.engine.layout
