"""Owns the KV storage, builds one step's flat batch and its geometry from the scheduler
output and the cache manager's plain data, and runs the model."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from headwise.cache.manager import KVCacheManager
from headwise.cache.ops import PageOut, RingClone, RingCopy
from headwise.engine import cuda_graphs
from headwise.engine.decode_capture import DecodeCapture
from headwise.engine.kv_storage import KVStorage
from headwise.engine.sequence import Sequence
from headwise.heads.base import head_class
from headwise.layers.backend import attention_backend
from headwise.layers.context import PrefillChunk, StepContext, step_context
from headwise.models.causal_lm import CausalLM


# Most logits of prompt tokens made at once when scoring a prompt (prompt_logprobs): a
# 2048-token chunk of a 152K vocabulary would be 1.2 GB of float32 in one piece.
SCORE_ELEMENTS = 1 << 25


@dataclass
class PromptScores:
    """Log-probabilities of prompt tokens `first`, `first` + 1, ... of `seq` (each given the
    tokens before it), computed in one step's prefill chunk: `chosen` [n] of the tokens
    themselves, with their `ranks` (1: the most likely), and the top k ids and values."""
    seq: Sequence
    first: int
    chosen: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_values: list[list[float]]


@dataclass
class StepOutput:
    logits: torch.Tensor                 # [S, V] float32 on the CPU: one row per sampling sequence
    seqs: list[Sequence]                 # those sequences
    prompt_scores: list[PromptScores]    # for the chunks of sequences with prompt_logprobs


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCacheManager, dtype: torch.dtype,
                 device: torch.device | str = "cpu", backend: str = "torch",
                 window_positions: str = "original", enforce_eager: bool | None = None,
                 max_num_seqs: int = 1, max_model_len: int | None = None,
                 compile_in_background: bool = False) -> None:
        self.model = model
        self.cache = cache
        self.dtype = dtype
        self.device = torch.device(device)
        self.backend = attention_backend(backend)
        # What the backend reads of the paged heads, built per step by the backend itself.
        self.metadata = self.backend.StepMetadata(cache, self.device, dtype)
        self.group_size = model.config.group_size
        self.rebased = window_positions == "rebased"
        # Each ring class with its parameters, and the class that builds its metadata.
        self.ring_kinds = [(kind, head_class(kind.name)) for kind in cache.geometry.ring_kinds()]
        # Decode in CUDA graphs (engine.cuda_graphs): where the backend's decode reads only
        # tensors, unless eager is enforced. Padding rows write into one spare block and
        # ring slot past the manager's books. Page selection (select heads) sizes its
        # work from the step's lengths on the host, so such layouts decode eagerly.
        capturer = (cuda_graphs.capturer_for(self.device)
                    if self.backend.PAGED and enforce_eager is not True and not self.rebased
                    and not cache.geometry.summary_heads else None)
        spare = int(capturer is not None)
        self.kv = KVStorage(cache.geometry, cache.num_blocks + spare, cache.num_ring_slots + spare, self.device,
                            page_bytes=cache.page_bytes, compute_dtype=dtype, hot_pages=cache.hot_pages)
        for l, attn in enumerate(model.attention_layers()):
            attn.bind(self.kv.layer_views(l), self.backend)
        self.forward = DecodeCapture(model, self.device, enforce_eager)
        # In the background only where nothing below needs the compiled body at start;
        # then the engine starts it once it is built (compile_in_background), since the
        # compile holds the GIL for most of its time.
        self.compile_later = compile_in_background and capturer is None
        if not self.compile_later:
            self.forward.warm_up()
        self.graphs = None
        if capturer is not None:
            max_len = max_model_len or model.config.max_position_embeddings
            shape = cuda_graphs.GraphShape(
                max_batch=max_num_seqs, max_blocks=-(-max_len // cache.block_size), block_size=cache.block_size,
                ring_kinds=[k for k, _ in self.ring_kinds], has_paged_heads=cache.has_paged_heads,
                pad_block=cache.num_blocks, pad_ring=cache.num_ring_slots)
            self.graphs = cuda_graphs.CudaGraphDecode(self.forward.hidden_states, capturer, self.device, shape)
            self.graphs.capture()

    def apply(self, ops: list, tier=None) -> None:
        """The cache manager's copies, in order: window-state snapshots (ring slot <->
        pages), ring slot -> scratch ring slot, pages out to the disk tier (before their
        reuse) and back in."""
        for op in ops:
            if isinstance(op, RingCopy):
                if op.save:
                    self.kv.write_pages(op.pages, self.kv.read_ring(op.ring_slot))
                else:
                    self.kv.write_ring(op.ring_slot, self.kv.read_pages(op.pages))
            elif isinstance(op, RingClone):
                self.kv.copy_ring(op.src, op.dst)
            elif isinstance(op, PageOut):
                tier.put(op.entry, self.kv.read_pages(op.pages).cpu())
            else:
                self.kv.write_pages(op.pages, op.data.to(self.device))

    def run(self, scheduled: list[tuple[Sequence, int]], logit_rows: list[int] | None = None) -> StepOutput:
        """Run one step: logits for the sequences that sample, and the prompt tokens'
        log-probabilities of the chunks whose sequences ask for them.

        With logit_rows, the logits of those tokens of the step come back instead (rows in
        the step's token order, decodes first); used by evaluation (perplexity) and tests."""
        ctx, ids, sampling_rows, sampling_seqs, scored = self._context(scheduled)
        dev = self.device
        scores = []
        with step_context(ctx):
            rows = torch.tensor(sampling_rows if logit_rows is None else logit_rows,
                                dtype=torch.int64, device=dev)
            ids = torch.tensor(ids, dtype=torch.int64, device=dev)
            if logit_rows is None and self.graphs is not None and self.graphs.applies(ctx):
                with torch.inference_mode():  # every decode row samples: rows are 0..B-1
                    logits = self.model.logits(self.graphs.replay(ctx, ids), rows)
            elif scored:
                with torch.inference_mode():
                    hidden = self.forward.hidden_states(ids, ctx.positions)
                    logits = self.model.logits(hidden, rows)
                    scores = [self._score(hidden, *chunk) for chunk in scored]
            else:
                logits = self.forward(ids, ctx.positions, rows)
        return StepOutput(logits.float().cpu(), sampling_seqs, scores)

    def _score(self, hidden: torch.Tensor, seq: Sequence, offset: int, start: int, n: int) -> PromptScores:
        # hidden: [T, D], the step's final hidden states. The logits at chunk row i (position
        # start + i) score prompt token start + i + 1; made SCORE_ELEMENTS at a time.
        k = seq.params.prompt_logprobs
        targets = torch.tensor(seq.prompt_token_ids[start + 1: start + 1 + n], dtype=torch.int64)
        out = PromptScores(seq, start + 1, [], [], [], [])
        step = max(1, SCORE_ELEMENTS // self.model.config.vocab_size)
        for a in range(0, n, step):
            b = min(n, a + step)
            rows = torch.arange(offset + a, offset + b, device=hidden.device)
            lp = torch.log_softmax(self.model.logits(hidden, rows), -1).cpu()  # [b - a, V] float32
            chosen = lp.gather(1, targets[a:b, None])  # [b - a, 1]
            out.chosen += chosen[:, 0].tolist()
            out.ranks += ((lp > chosen).sum(1) + 1).tolist()
            if k:
                vals, idx = lp.topk(k, dim=1)
                out.top_ids += idx.tolist()
                out.top_values += vals.tolist()
        return out

    def _context(self, scheduled: list[tuple[Sequence, int]]):
        # Decode entries (one generated token on top of cached context) go first and are
        # batched together; prefill chunks follow, each attended on its own. A prompt's
        # last token computed alone (after a prefix hit) is a chunk of one: prompt tokens
        # are attended as prefill (select heads choose pages for generated tokens only).
        def decoding(s, n):
            return n == 1 and 0 < s.num_computed_tokens >= s.num_prompt_tokens

        decodes = [(s, n) for s, n in scheduled if decoding(s, n)]
        prefills = [(s, n) for s, n in scheduled if not decoding(s, n)]
        cache, dev, meta = self.cache, self.device, self.metadata
        ids, pos, slots, chunks = [], [], [], []
        sampling_rows, sampling_seqs = [], []
        scored = []  # (seq, offset, start, n): prefill rows whose logits score the next prompt token
        offset = 0
        for i, (seq, n) in enumerate(decodes + prefills):
            start, sid = seq.num_computed_tokens, seq.seq_id
            ids.extend(seq.token_ids(start, start + n))
            pos.extend(range(start, start + n))
            slots.extend(cache.slot_mapping(sid, start, start + n))
            if i >= len(decodes):
                ch = PrefillChunk(offset, start, n, cache.ring_slot(sid), meta.chunk_pages(sid, start, n),
                                  generated_from=seq.num_prompt_tokens)
                for kind, cls in self.ring_kinds:
                    ch.window[kind] = cls.prefill_geometry(start, n, kind.sink, kind.window, self.group_size,
                                                           self.dtype, dev, for_kernels=self.backend.PAGED)
                for point, slot in cache.chunk_snapshots(sid):
                    ch.snapshots.append((slot, {kind: cls.ring_writes(start, point - start, kind.sink, kind.window, dev)
                                                for kind, cls in self.ring_kinds}))
                chunks.append(ch)
                if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                    scored.append((seq, offset, start, min(n, seq.num_prompt_tokens - 1 - start)))
            offset += n
            if start + n == seq.num_tokens:
                sampling_rows.append(offset - 1)
                sampling_seqs.append(seq)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        ctx = StepContext(positions=positions, full_slots=torch.tensor(slots, dtype=torch.int64, device=dev),
                          block_size=cache.block_size, num_decode=len(decodes), prefills=chunks)
        if decodes:
            B = len(decodes)
            seq_ids = [s.seq_id for s, _ in decodes]
            lens = [s.num_computed_tokens + 1 for s, _ in decodes]
            ring_slots = [cache.ring_slot(s) for s in seq_ids]
            ctx.decode_lens = torch.tensor(lens, device=dev)
            ctx.decode_ring_slots = torch.tensor(ring_slots, device=dev)
            for kind, cls in self.ring_kinds:
                ctx.decode_ring_index[kind] = cls.ring_index(positions[:B], kind.sink, kind.window)
            ctx.decode = meta.decode(seq_ids, lens, ring_slots)
        if self.rebased:
            rotary = self.model.model.rotary
            tables = {kind: cls.rebased_tables(rotary, positions, kind.sink, kind.window)
                      for kind, cls in self.ring_kinds}
            ctx.sink_rope = {kind: t for kind, t in tables.items() if t is not None}
        return ctx, ids, sampling_rows, sampling_seqs, scored
