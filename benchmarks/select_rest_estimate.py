"""Experiment (issue #34, not an engine feature): do select heads lose word-frequency
prompts because the pages they skip stop counting at all? Here every page a select head
did not choose still enters its softmax, as one pseudo-token with the page's mean key and
mean value and a log(block_size) bias (the page's 16 tokens as if their keys were equal;
RetroInfer-style estimation of the rest). The chosen pages are attended exactly, as the
engine does. Runs `headwise` with that decode, eagerly, in PyTorch (slow; for quality
only), e.g.

    python benchmarks/select_rest_estimate.py eval --model qwen2.5-coder-0.5b --suite \
        --no-reference --head-layout headwise/layouts/qwen2.5-coder-0.5b-instruct-gates-60-w1024-select2048.json \
        --families fwe,cwe --seeds 3 --lengths 8000 --enforce-eager \
        --report docs/quality/qwen05-gates-50-w1024-8k.json --json rest.json

HEADWISE_REST=0 attends the chosen pages only (the engine's decode, recomputed here).
Plainly stored (not int8) KV only.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from headwise import cli  # noqa: E402
from headwise.heads import select  # noqa: E402

WITH_REST = os.environ.get("HEADWISE_REST", "1") == "1"
_step = {}  # the decode step's context, for the block tables the page choice leaves out


def rest_decode(q, group, picked, block_size: int, scale: float) -> torch.Tensor:
    """q [B, n*g, D]; picked = (tables [n, B, K], lens [n, B]) as select_pages returns."""
    ctx = _step.get("ctx")
    if ctx is None:  # rows recomputed within a prefill (after preemption): as the engine does
        return _step["engine"](q, group, picked, block_size, scale)
    if group.k.scale is not None:
        raise SystemExit("select_rest_estimate: plainly stored KV only (no --kv-cache-dtype int8)")
    tables, lens = picked
    n = group.num_heads
    B, H, _ = q.shape
    g = H // n
    out = torch.empty_like(q)
    within = torch.arange(block_size)
    for b in range(B):
        L = int(ctx.decode_lens[b])
        P = -(-L // block_size)
        tail = L - (P - 1) * block_size  # tokens of the last page, always chosen and last
        blocks = ctx.decode.block_tables[b, :P].long()
        for h in range(n):
            chosen_len = int(lens[h, b])
            chosen = tables[h, b, :(chosen_len - tail) // block_size + 1].long()
            slots = (chosen[:, None] * block_size + within).flatten()[:chosen_len]
            k, v = group.k.data[h, slots].float(), group.v.data[h, slots].float()  # [T, D]
            qh = q[b, h * g:(h + 1) * g].float()                                      # [g, D]
            s = qh @ k.T * scale
            rest = blocks[~torch.isin(blocks, chosen)]  # whole pages only
            if WITH_REST and rest.numel():
                rs = rest[:, None] * block_size + within                              # [R, bs]
                k_mean, v_mean = group.k.data[h, rs].float().mean(1), group.v.data[h, rs].float().mean(1)
                s = torch.cat([s, qh @ k_mean.T * scale + math.log(block_size)], 1)
                v = torch.cat([v, v_mean], 0)
            out[b, h * g:(h + 1) * g] = (torch.softmax(s, -1) @ v).to(q.dtype)
    return out


def main() -> int:
    engine_decode = select.SelectHeads.decode

    def decode(self, layer, group, ctx, q):
        _step["ctx"] = ctx
        try:
            return engine_decode(self, layer, group, ctx, q)
        finally:
            _step["ctx"] = None

    _step["engine"] = select._IMPLS["torch"]
    select.SelectHeads.decode = decode
    select._IMPLS["torch"] = rest_decode
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
