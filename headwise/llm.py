"""Offline API: LLM(model).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import math
from dataclasses import dataclass

from tqdm import tqdm

from headwise.config import EngineConfig
from headwise.engine.llm_engine import LLMEngine
from headwise.engine.sequence import Sequence
from headwise.sampling import SamplingParams
from headwise.tokenizer import ChatOptions


@dataclass
class CompletionOutput:
    """One choice of a prompt (SamplingParams.n of them)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    num_cached_tokens: int          # prompt tokens this choice found in the prefix cache
    error: str | None = None        # why it failed (finish_reason "abort"), e.g. a grammar past its limits
    # Sum of the tokens' logprobs (vLLM's field), where they were computed: logprobs asked
    # for, or best_of > n (the choices are ranked by it).
    cumulative_logprob: float | None = None

    @classmethod
    def from_seq(cls, index: int, seq: Sequence, asked: SamplingParams) -> "CompletionOutput":
        """Choice `index` of a request that `asked` these params (the sequence's own may
        compute logprobs that were not asked for: best_of)."""
        computed = seq.params.logprobs is not None
        shown = asked.logprobs is not None
        return cls(index, seq.output_text, list(seq.output_token_ids), seq.finish_reason,
                   list(seq.logprobs) if shown else None,
                   list(seq.top_logprobs) if shown and asked.logprobs else None,
                   seq.num_cached_tokens or 0, seq.error, math.fsum(seq.logprobs) if computed else None)


@dataclass
class RequestOutput:
    """A prompt's result. text, token_ids, finish_reason, logprobs and top_logprobs are
    its first choice's; `outputs` holds every choice (one unless SamplingParams.n > 1)."""
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
    num_cached_tokens: int          # prompt tokens served from the prefix cache (first choice)
    outputs: list[CompletionOutput]
    # With SamplingParams.prompt_logprobs (vLLM's form): per prompt token, None for the
    # first, else {its id: its logprob given the tokens before it} plus the top k there.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], asked: SamplingParams) -> "RequestOutput":
        """A prompt's result from its choices' sequences (asked.choices of them; the best n
        kept where best_of > n)."""
        first = seqs[0]
        every = [CompletionOutput.from_seq(i, s, asked) for i, s in enumerate(seqs)]
        outputs = [every[i] for i in asked.best([o.cumulative_logprob for o in every])]
        for i, o in enumerate(outputs):
            o.index = i
        o = outputs[0]
        return cls(
            request_id=first.request_id, prompt_token_ids=first.prompt_token_ids, text=o.text,
            token_ids=o.token_ids, finish_reason=o.finish_reason, logprobs=o.logprobs,
            top_logprobs=o.top_logprobs, ttft_s=first.ttft_s, latency_s=first.latency_s,
            num_preemptions=sum(s.num_preemptions for s in seqs), num_cached_tokens=o.num_cached_tokens,
            outputs=outputs, prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
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
        # Each prompt's n choices are sequences of their own (seeds + i); choices after the
        # first are queued once the first has prefilled the prompt, so they find it in
        # the prefix cache instead of computing it again.
        encoded = [self.engine.encode(p) for p in prompts]
        groups: list[list[Sequence]] = []
        for ids, p in zip(encoded, per_prompt):
            self.engine.check_length(len(ids), p.max_tokens)
            groups.append([self.engine.new_sequence(ids, p.for_choice(i)) for i in range(p.choices)])
        queued: list[Sequence] = []
        try:
            for g in groups:
                self.engine.add_sequence(g[0])
                queued.append(g[0])
            self._run(groups, queued, use_tqdm and len(queued) > 1)
        except BaseException:
            for s in queued:
                if not s.is_finished:
                    self.engine.abort(s)
            raise
        return [RequestOutput.from_seqs(g, p) for g, p in zip(groups, per_prompt)]

    def chat(self, messages, params: "SamplingParams | list[SamplingParams] | None" = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """`messages`: one conversation (a list of {role, content}) or a list of them;
        `params` as in generate; the rest as in vLLM's LLM.chat (tokenizer.ChatOptions):
        `tools` are shown to the model by its template, the reply is its raw text."""
        options = ChatOptions(add_generation_prompt, continue_final_message, chat_template_kwargs or {}, tools)
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c, options) for c in convs]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, groups: list[list[Sequence]], queued: list[Sequence], progress: bool) -> None:
        bar = tqdm(total=len(groups), desc="generating", unit="req") if progress else None
        waiting = [g for g in groups if len(g) > 1]  # choices not queued yet
        done = 0
        while self.engine.has_unfinished():
            self.engine.step()
            for g in [g for g in waiting if g[0].output_token_ids or g[0].is_finished]:
                waiting.remove(g)
                for s in g[1:]:
                    self.engine.add_sequence(s)
                    queued.append(s)
            if bar is not None:
                now = sum(all(s.is_finished for s in g) for g in groups)
                bar.update(now - done)
                done = now
        if bar is not None:
            bar.close()

    def kv_bytes(self, num_tokens: int) -> int:
        """KV bytes one sequence of `num_tokens` tokens occupies under the current layout."""
        return self.engine.kv_bytes(num_tokens)

    def cache_usage(self) -> dict[str, dict[str, float]]:
        return self.engine.stats().usage

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
