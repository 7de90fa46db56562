"""Builds one step's flat batch from the scheduler output and runs the model."""
from __future__ import annotations

import torch

from headwise.cache.manager import KVCacheManager
from headwise.engine.sequence import Sequence
from headwise.layers.context import PrefillChunk, StepContext, set_context
from headwise.models.llama import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCacheManager,
                 device: torch.device | str = "cpu", backend: str = "torch") -> None:
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        # "triton" kernels read pages through block tables; "torch" reads slot lists/runs.
        self.backend = backend
        cache.bind(model.attention_layers(), backend)

    def run(self, scheduled: list[tuple[Sequence, int]],
            all_logits: bool = False) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step; returns logits [S, V] (float32, on the CPU) for the sequences that
        sample, and those.

        With all_logits, logits of every token of the step come back instead, in the
        step's token order (decodes first); used by evaluation (perplexity) and tests."""
        # Decode-shaped entries (one new token on top of cached context) go first and are
        # batched together; prefill chunks follow, each attended on its own.
        decodes = [(s, n) for s, n in scheduled if n == 1 and s.num_computed_tokens > 0]
        prefills = [(s, n) for s, n in scheduled if not (n == 1 and s.num_computed_tokens > 0)]
        ordered = decodes + prefills
        full, ring = self.cache.full, self.cache.ring
        dev, tables = self.device, self.backend == "triton" and full.num_heads > 0
        ids, pos, slots, prefill_ctx = [], [], [], []
        sampling_rows, sampling_seqs = [], []
        offset = 0
        for i, (seq, n) in enumerate(ordered):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids(start, start + n))
            pos.extend(range(start, start + n))
            # With the torch backend, prefill chunks after the first gather every earlier
            # slot; the Triton kernel reads pages through the block table instead.
            lo = 0 if (i >= len(decodes) and start > 0 and not tables) else start
            seq_slots = (full.slots(seq.seq_id, lo, start + n) if full.num_heads
                         else torch.zeros(start + n - lo, dtype=torch.int64))
            slots.append(seq_slots[start - lo:])
            if i >= len(decodes):
                table = (torch.tensor(full.block_table(seq.seq_id), dtype=torch.int32, device=dev)
                         if tables else None)
                prefill_ctx.append(PrefillChunk(offset, start, n, seq_slots.to(dev),
                                                ring.slot(seq.seq_id), table))
            offset += n
            if start + n == seq.num_tokens:
                sampling_rows.append(offset - 1)
                sampling_seqs.append(seq)
        ctx = StepContext(
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            full_slots=torch.cat(slots).to(dev),
            num_decode=len(decodes),
            prefills=prefill_ctx,
        )
        if decodes:
            lens = [s.num_computed_tokens + 1 for s, _ in decodes]
            ctx.decode_lens = torch.tensor(lens, device=dev)
            ctx.decode_ring_slots = torch.tensor([ring.slot(s.seq_id) for s, _ in decodes], device=dev)
            if tables:
                rows = [full.block_table(s.seq_id) for s, _ in decodes]
                width = max(map(len, rows))
                ctx.decode_block_tables = torch.tensor([r + [0] * (width - len(r)) for r in rows],
                                                       dtype=torch.int32, device=dev)
            elif full.num_heads:
                ctx.decode_runs = [full.slot_runs(s.seq_id, s.num_computed_tokens + 1) for s, _ in decodes]
        set_context(ctx)
        try:
            rows = (torch.arange(len(ids), device=dev) if all_logits
                    else torch.tensor(sampling_rows, dtype=torch.int64, device=dev))
            logits = self.model(torch.tensor(ids, dtype=torch.int64, device=dev), ctx.positions, rows)
        finally:
            set_context(None)
        return logits.float().cpu(), sampling_seqs
