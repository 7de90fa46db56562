"""Structured outputs in the engine: one llguidance matcher per constrained sequence,
and the step's token masks, filled for all of them at once.

A constraint is compiled once per distinct spec (cached, compiled template matchers; each
request gets a copy). Compiling runs on the caller's thread: the server calls `matcher`
off the engine thread, so a slow schema never stalls a step.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import torch

from headwise.errors import InvalidParameterError
from headwise.structured import StructuredOutputs

# (mask word >> SHIFTS) & 1 unpacks a 32-bit mask word into its 32 token bits.
_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer  # a headwise Tokenizer: llguidance reads its HF tokenizer
        self.vocab_size = vocab_size  # the model's (logits' width); may exceed the tokenizer's
        self.cache_size = cache_size
        self._tok: llguidance.LLTokenizer | None = None
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.executor = llguidance.LLExecutor()
        self.compiled = 0  # distinct constraints compiled (the cache's misses)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._tok is None:  # about 0.4 s for a 49K vocabulary, once
            self._tok = llguidance.hf.from_tokenizer(self.tokenizer.hf, n_vocab=self.vocab_size)
        return self._tok

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher for `spec`; raises InvalidParameterError if it cannot compile."""
        key = spec.key()
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
            else:
                template = llguidance.LLMatcher(self._tokenizer(), spec.lark())
                # The first mask builds the lexer (seconds for a huge regex): here, on the
                # caller's thread, not in an engine step. A grammar past llguidance's
                # limits fails now, as bad input.
                template.compute_bitmask()
                if template.is_error():
                    raise InvalidParameterError(spec.param, f"{spec.param}: {template.get_error().strip()}")
                self.compiled += 1
                self._templates[key] = template
                if len(self._templates) > self.cache_size:
                    self._templates.popitem(last=False)
        m = template.deep_copy()
        m.compute_bitmask()  # a copy builds its own first lexer states (0.2 s for a huge regex)
        return m

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list[llguidance.LLMatcher]) -> None:
        """Set to -inf, in place, the logits [S, V] of tokens each row's grammar forbids now."""
        words = (logits.shape[1] + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        # llguidance.torch's fill_next_token_bitmask_par is this call (its module imports
        # torch._dynamo: 2 s of every start): row j's mask into bitmask[j], 4 bytes a word
        self.executor.unsafe_compute_mask_ptr(list(zip(matchers, range(len(rows)))), bitmask.data_ptr(),
                                              words * 4, len(rows))
        for j, m in enumerate(matchers):
            if m.is_error():  # past a limit mid-way: the engine ends the sequence with the error
                bitmask[j] = -1
        allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(len(rows), -1)[:, :logits.shape[1]]
        idx = torch.tensor(rows)
        logits[idx] = logits[idx].masked_fill(allowed == 0, float("-inf"))


def consume(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Advance the matcher past the sampled token; True when the grammar is complete."""
    if not matcher.consume_token(token):
        # The mask allowed only tokens the grammar takes, so this is a bug, not bad input.
        raise RuntimeError(f"structured output: token {token} rejected ({matcher.get_error()})")
    return matcher.is_stopped()
