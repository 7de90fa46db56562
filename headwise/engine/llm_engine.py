"""LLMEngine: request in, tokens out. One step = schedule -> run model -> sample -> update."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from headwise.cache.disk_tier import DiskTier, TierStats, fingerprint
from headwise.cache.manager import KVCacheManager
from headwise.cache.prefix_cache import PrefixStats
from headwise.cache.spec import KVClassSpec
from headwise.config import ConfigError, EngineConfig
from headwise.engine.model_runner import ModelRunner, PromptScores
from headwise.engine.sampler import bad_word_ids, sample
from headwise.engine.scheduler import Scheduler
from headwise.engine.detokenizer import IncrementalDetokenizer
from headwise.engine.grammar import GrammarCompiler, consume
from headwise.engine.request_checks import check_length, check_params, check_token_ids
from headwise.engine.sequence import Sequence
from headwise.heads.base import PAGED, head_class
from headwise.heads.layout import resolve_layout
from headwise.kernels import codes_gemm, cpu_kernels
from headwise.layouts import check_native_windows, native_layout, shipped_layout
from headwise.models.head_order import permute_model_heads
from headwise.errors import InvalidParameterError
from headwise.sampling import SamplingParams
from headwise.models.causal_lm import CausalLM
from headwise.weights.loader import (checkpoint_dtype, keep_freed_heap, load_tokenizer, load_weights, model_identity,
                                     read_model_config, release_freed_heap, resolve_model_path)
from headwise.weights.prepared import PreparedWeights
from headwise.weights.registry import cache_dir

# Most logits prompt_logprobs holds at once (float32 elements; 2 GiB)
LOGPROB_ELEMENTS = 1 << 29


def _store_prompt_scores(sc: PromptScores) -> None:
    """Into sc.seq.prompt_logprobs: per prompt position, the token's own logprob and the top k
    (a recomputation after preemption writes the same positions again)."""
    table = sc.seq.prompt_logprobs
    tok = sc.seq.prompt_token_ids
    for i, lp in enumerate(sc.chosen):
        p = sc.first + i
        entry = dict(zip(sc.top_ids[i], sc.top_values[i])) if sc.top_ids else {}
        entry[tok[p]] = lp
        table[p] = entry
        sc.seq.prompt_ranks[p] = sc.ranks[i]


@dataclass(frozen=True)
class EngineStats:
    """What a server or a client reads of a running engine, in one call (engine.stats())."""
    num_running: int
    num_waiting: int
    usage: dict[str, dict[str, float]]   # per storage kind (paged, ring): used/total/cached bytes, usage
    prefix: PrefixStats                  # cumulative prompt tokens looked up and hit
    tier: TierStats | None               # the disk tier's counters (None: no tier)
    kv_formats: dict[str, KVClassSpec]   # how each head class of the layout stores K/V


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: tuple | None = None) -> None:
        """`loaded`: an already built (CausalLM, tokenizer) on the config's device and
        dtype, used instead of loading `config.model` (benchmarks with random weights).
        The engine reorders its heads for the layout, so it owns that model from then on."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if loaded:
            self.model, self.tokenizer = loaded
            self.dtype = next(self.model.parameters()).dtype
            mcfg = self.model.config
        else:
            self.dtype = config.resolve_dtype(checkpoint_dtype(config.model))
            mcfg = read_model_config(config.model)
        self.model_config = mcfg
        self.model_name = mcfg.name
        self.dense_weights = config.keeps_dense_weights(self.dtype, codes_gemm.available)
        shape = (mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim)
        native = native_layout(mcfg)
        self.layout = resolve_layout(config.head_layout, shape, mcfg.name,
                                     default=shipped_layout(mcfg.name, shape) or native, native=native)
        check_native_windows(self.layout, mcfg)
        bases = len({mcfg.rope_theta_of(l) for l in range(mcfg.num_layers)})
        if config.window_positions == "rebased" and bases > 1:
            raise ConfigError("window_positions='rebased' needs one rotary base for every layer; "
                              f"{mcfg.name} has {bases}")
        self.prepared: PreparedWeights | None = None
        if loaded:
            permute_model_heads(self.model, self.layout)
            self.model.prepare_weights(self.dtype, self.dense_weights)  # after the permutation (plain weights)
        else:
            # Beside the weights, whose preparation leaves a core idle for much of its time:
            # the tokenizer and, on the CPU, the C kernels (a first build runs the compiler).
            with ThreadPoolExecutor(2, thread_name_prefix="engine-start") as pool:
                tokenizer = pool.submit(load_tokenizer, config.model)
                if config.torch_device.type == "cpu":
                    pages_chosen = any(head_class(c).page_summary for c in self.layout.class_counts())
                    pool.submit(cpu_kernels.build_for_engine, pages_chosen)
                self.model = self._prepared_model(config, mcfg)
                self.tokenizer = tokenizer.result()
        release_freed_heap()  # before the KV pools are allocated
        keep_freed_heap()  # then a step's temporaries reuse memory instead of faulting in pages
        limit = mcfg.max_position_embeddings
        if mcfg.sliding_window and not mcfg.sliding_layers:
            # The same window in every layer (Mistral) is not modelled by a layout.
            limit = min(limit, mcfg.sliding_window)
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.cache = KVCacheManager(self.layout, config.block_size, config.kv_cache_memory,
                                    config.max_num_seqs, self.dtype, config.enable_prefix_caching,
                                    config.kv_cache_dtype, config.select_host_pages, config.select_hot_pages,
                                    config.select_host_memory)
        geo = self.cache.geometry
        # How each head class of the layout stores K/V: its storage kind's spec (EngineStats).
        self.kv_formats = {c: geo.paged if head_class(c).storage == PAGED else geo.ring
                           for c in self.layout.class_counts()}
        if torch.float8_e4m3fn in (geo.paged.dtype, geo.ring.dtype) and config.torch_device.type != "cuda":
            raise ConfigError(f"layout {self.layout.name!r} stores KV as fp8_e4m3, which needs a CUDA "
                              "device; on the CPU use int8")
        if config.kv_offload_dir or config.kv_offload_host_bytes:
            fp = fingerprint(model_identity(config.model) if not loaded else mcfg.name,
                             self.cache.root, f"{self.dtype}/{geo.paged.label}/{geo.ring.label}"
                             + ("/select-host" if self.cache.hot_pages else ""),  # a page's byte order
                             config.block_size)
            self.cache.attach_tier(DiskTier(config.kv_offload_dir, config.kv_offload_bytes, fp,
                                            config.kv_offload_host_bytes, pin=config.torch_device.type == "cuda"))
        self.runner = ModelRunner(self.model, self.cache, self.dtype, config.torch_device,
                                  config.backend, config.window_positions, config.enforce_eager,
                                  config.max_num_seqs, self.max_model_len, config.compile_in_background)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_queue)
        self.eos_ids = set(mcfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.grammar = GrammarCompiler(self.tokenizer, mcfg.vocab_size)
        if self.runner.compile_later:  # last: the compile thread holds the GIL for most of its time
            self.runner.forward.warm_up(background=True)

    def _prepared_model(self, config: EngineConfig, mcfg) -> CausalLM:
        """The model with its heads in the layout's order and its weights prepared: read
        from the prepared-weights cache (weights.prepared) where it holds this model file,
        dtype and head order; else loaded, permuted, prepared, and written there in the
        background."""
        path = resolve_model_path(config.model)
        if config.prepared_weights_cache and config.torch_device.type == "cpu" and path.is_file():
            order = [self.layout.head_order(l) for l in range(mcfg.num_layers)]
            self.prepared = PreparedWeights(cache_dir() / "prepared", path, self.dtype, order,
                                            self.dense_weights)
            model = self.prepared.load(mcfg)
            if model is not None:
                return model
        # Loaded as float32 and cast in prepare_weights, after the 4-bit weights are
        # recognised (exactly only before rounding to 16 bits); a GGUF's block-format
        # weights stay codes until then (lazy), made dense one at a time in the compute dtype.
        model = load_weights(config.model, torch.float32, config.torch_device, lazy=True)
        permute_model_heads(model, self.layout)
        model.prepare_weights(self.dtype, self.dense_weights)  # after the permutation (plain weights)
        if self.prepared is not None:
            self.prepared.save_in_background(model)
        return model

    # ---- requests -----------------------------------------------------------------
    def encode(self, prompt: "str | list[int]") -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return check_token_ids(prompt, self.model_config.vocab_size)

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        check_length(num_prompt_tokens, max_tokens, self.max_model_len)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against this vocabulary, and
        one choice per sequence (the LLM and the server fan n out into choices), and
        allowed_token_ids that leave something to sample before min_tokens (when the stop
        tokens are masked)."""
        check_params(params, self.model_config.vocab_size)
        if params.allowed_token_ids and params.min_tokens:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
            if stops.issuperset(params.allowed_token_ids):
                raise InvalidParameterError("allowed_token_ids", "allowed_token_ids holds only stop tokens, "
                                            "which min_tokens forbids until it is reached")

    def new_sequence(self, ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """A checked sequence, its structured-output matcher compiled (on this thread)."""
        self.check_params(params)
        seq = Sequence(ids, params, request_id)
        if params.bad_words:
            seq.bad_word_ids = bad_word_ids(self.tokenizer, params.bad_words)
        if params.structured_outputs is not None:
            seq.matcher = self.grammar.matcher(params.structured_outputs)
        return seq

    def add_request(self, prompt: "str | list[int]", params: SamplingParams,
                    request_id: str | None = None) -> Sequence:
        ids = self.encode(prompt)
        self.check_length(len(ids), params.max_tokens)
        seq = self.new_sequence(ids, params, request_id)
        self.add_sequence(seq)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence made by new_sequence (raises QueueFullError past max_queue)."""
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one engine step; returns the sequences that got a new token."""
        out = self.scheduler.schedule()
        self._run_cache_copies()  # window state of prefix-cache hits, before they are attended
        if not out.scheduled:
            if self.cache.tier is not None:  # maybe a prefix on its way back from disk
                self.cache.tier.wait_for_reads(0.05)
            return []
        step = self.runner.run(out.scheduled)
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            self.cache.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        self._run_cache_copies()  # window-state snapshots planned at this step's ends
        for sc in step.prompt_scores:
            _store_prompt_scores(sc)
        seqs = step.seqs
        if not seqs:
            return []
        results = sample(step.logits, seqs, self.eos_ids, self.grammar)
        now = time.perf_counter()
        for seq, r in zip(seqs, results):
            self._append(seq, r, now)
        return seqs

    def _run_cache_copies(self) -> None:
        ops = self.cache.pop_ops()
        if ops:
            self.runner.apply(ops, self.cache.tier)
            self.cache.ops_done(ops)

    def offload_prefix_cache(self) -> None:
        """Copy every cached prefix to the disk tier, if any, and wait for the writes."""
        if self.cache.tier is not None:
            self.cache.offload_all()
            self._run_cache_copies()
            self.cache.tier.flush()

    def close(self) -> None:
        """Offload the prefix cache (see offload_prefix_cache) and stop the tier's threads."""
        if self.cache.tier is not None:
            self.offload_prefix_cache()
            self.cache.tier.close()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the number of pages that held one."""
        return self.cache.reset_prefix_cache()

    def _append(self, seq: Sequence, r, now: float) -> None:
        if seq.matcher is not None and seq.matcher.is_error():
            # The grammar hit one of llguidance's limits at this step; its token is dropped.
            seq.error = f"structured output failed: {seq.matcher.get_error().strip()}"
        elif r.token is None:
            seq.error = ("no token may be sampled: allowed_token_ids, bad_words and the structured-output "
                         "constraint together leave none")
            seq.error_code = "no_token_allowed"
        if seq.error is not None:
            seq.finish_reason, seq.finish_time = "abort", now
            self.scheduler.finish(seq)
            return
        seq.output_token_ids.append(r.token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_times.append(now)
        p = seq.params
        if p.logprobs is not None:
            seq.logprobs.append(r.logprob)
            if r.top_logprobs is not None:
                seq.top_logprobs.append(r.top_logprobs)
        detok = seq.detokenizer
        if detok is None:
            detok = seq.detokenizer = IncrementalDetokenizer(self.tokenizer, p.stop, p.include_stop_str_in_output,
                                                             p.skip_special_tokens)
        reason = None
        grammar_done = seq.matcher is not None and consume(seq.matcher, r.token)
        if r.token in p.stop_token_ids or (not p.ignore_eos and r.token in self.eos_ids):
            reason = "stop"
            # The stop token's text is not output unless asked for (vLLM).
            ids = seq.output_token_ids
            detok.flush(ids if p.include_stop_str_in_output else ids[:-1])
        # Before min_tokens the sampler masked the stop tokens, and stop strings wait (vLLM).
        elif detok.step(seq.output_token_ids, check_stop=len(seq.output_token_ids) >= p.min_tokens):
            reason = "stop"
        elif grammar_done:
            reason = "stop"  # nothing but the end can follow
            detok.flush(seq.output_token_ids)
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
            detok.flush(seq.output_token_ids)
        seq.output_text = detok.text
        if reason:
            seq.finish_reason = reason
            seq.finish_time = now
            self.scheduler.finish(seq)

    def prompt_logits(self, ids: list[int], chunk_size: int | None = None,
                      positions: list[int] | None = None) -> torch.Tensor:
        """Logits [len(positions), V] of the prompt at `positions` (default: every one, [T, V]),
        prefilled in chunks of `chunk_size` (default: the step token budget). Used for
        parity checks and calibration (positions=[])."""
        return torch.cat(list(self._prefill_logits(ids, chunk_size, positions)))

    def prompt_logprobs(self, ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Log-probabilities [T - 1] of each prompt token after the ones before it
        (perplexity). Chunks hold at most LOGPROB_ELEMENTS logits, so a 262K vocabulary at
        32K tokens needs 2 GiB at a time, not 34."""
        chunk = min(chunk_size or self.config.max_num_batched_tokens,
                    max(1, LOGPROB_ELEMENTS // self.model_config.vocab_size))
        out, start = [], 0
        target = torch.tensor(ids[1:] + [0])
        for logits in self._prefill_logits(ids, chunk, None):
            n = logits.shape[0]
            lp = torch.log_softmax(logits, -1).gather(1, target[start: start + n, None])[:, 0]
            out.append(lp)
            start += n
        return torch.cat(out)[:-1]

    def _prefill_logits(self, ids: list[int], chunk_size: int | None, positions: list[int] | None):
        # Yields each chunk's logits at the wanted positions, one prefill of `ids`.
        self.check_length(len(ids), 0)
        chunk = chunk_size or self.config.max_num_batched_tokens
        wanted = range(len(ids)) if positions is None else sorted(set(positions))
        if any(not 0 <= p < len(ids) for p in wanted):
            raise ValueError(f"positions must lie in [0, {len(ids)})")
        seq = Sequence(ids, SamplingParams(max_tokens=1))
        if not self.cache.can_allocate(len(ids)):
            raise RuntimeError("not enough free KV cache to score this sequence now")
        self.cache.allocate(seq.seq_id, 0)
        try:
            while seq.num_computed_tokens < len(ids):
                start = seq.num_computed_tokens
                n = min(chunk, len(ids) - start)
                self.cache.append(seq.seq_id, start + n)
                self._run_cache_copies()  # pages it took may hold evicted prefixes for the disk tier
                rows = [p - start for p in wanted if start <= p < start + n]
                logits = self.runner.run([(seq, n)], logit_rows=rows).logits
                seq.num_computed_tokens += n
                yield logits
        finally:
            self.cache.free(seq.seq_id)

    # ---- accounting ---------------------------------------------------------------
    def kv_bytes(self, num_tokens: int) -> int:
        return self.cache.kv_bytes(num_tokens)

    @property
    def max_kv_tokens_per_seq(self) -> int:
        """The most tokens the KV pools can hold for one sequence."""
        return self.cache.max_tokens_per_seq()

    def stats(self) -> EngineStats:
        tier = self.cache.tier
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.cache.usage(),
                           self.cache.index.stats, None if tier is None else tier.stats,
                           self.kv_formats)

