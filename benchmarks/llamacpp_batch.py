"""Batched decode with llama.cpp's low-level API: `num_seqs` sequences, each with its own
KV stream (kv_unified off, as llama-server's parallel slots), decoded in one batch."""
from __future__ import annotations

import ctypes
import time

UBATCH = 512  # llama.cpp micro-batch, in every context the benchmarks make


def batched_decode(system, context: int, num_seqs: int, steps: int) -> float:
    import llama_cpp as lc

    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(system.path.encode(), lc.llama_model_default_params())
    cp = lc.llama_context_default_params()
    per_seq = -(-(context + steps + 8) // 256) * 256  # llama.cpp rounds n_ctx per sequence to 256
    cp.n_ctx = num_seqs * per_seq
    cp.n_batch = 2048
    cp.n_ubatch = UBATCH
    cp.n_seq_max = num_seqs
    cp.n_threads = cp.n_threads_batch = system.threads
    cp.kv_unified = False
    cp.swa_full = system.swa_cells is None  # a model's sliding-window layers keep only the window
    if system.flash is not None:  # newer llama.cpp: an enum (-1 auto, 0 off, 1 on); older: a bool
        if hasattr(cp, "flash_attn_type"):
            cp.flash_attn_type = int(system.flash)
        else:
            cp.flash_attn = system.flash
    if system.q8_kv:
        cp.type_k = cp.type_v = lc.GGML_TYPE_Q8_0
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context of that size")
    batch = lc.llama_batch_init(max(2048, num_seqs), 0, 1)
    try:
        ids = [(100 + 7 * i) % 30000 + 50 for i in range(context)]
        # Prefill sequence 0, then copy its KV into every other sequence's own stream.
        for start in range(0, context, 2048):
            chunk = ids[start: start + 2048]
            _fill(batch, [(t, start + i, 0) for i, t in enumerate(chunk)], last_logits=True)
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed during prefill")
        mem = lc.llama_get_memory(ctx)
        for s in range(1, num_seqs):
            lc.llama_memory_seq_cp(mem, 0, s, -1, -1)
        pos = context

        def step():
            nonlocal pos
            _fill(batch, [(100 + s, pos, s) for s in range(num_seqs)], last_logits=False, all_logits=True)
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed during decode")
            pos += 1

        step()  # warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return num_seqs * steps / (time.perf_counter() - t0)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def _fill(batch, items, last_logits: bool, all_logits: bool = False) -> None:
    batch.n_tokens = len(items)
    for i, (tok, pos, seq) in enumerate(items):
        batch.token[i] = tok
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = ctypes.c_int8(1 if all_logits or (last_logits and i == len(items) - 1) else 0)
