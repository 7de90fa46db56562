"""Incremental detokenization and stop strings, with bounded work per token.

Decoding a request's whole output again for every new token is quadratic in its length.
As vLLM does, only a short tail is decoded per step: the tokens since `prefix_offset`,
whose text up to `read_offset` was already emitted; the difference is the new text. A
tail that ends inside a UTF-8 character (decodes to U+FFFD) is held back until the
character completes. Stop strings are searched only where a match can end in new text;
the text ends before the first match, or after it with include_stop (vLLM's
include_stop_str_in_output).
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.max_stop = max((len(s) for s in stop), default=0)
        self.prefix_offset = 0  # tokens before it are done
        self.read_offset = 0    # text of tokens [prefix_offset, read_offset) is emitted
        self.text = ""
        # Work done so far, for tests that check it stays bounded per token.
        self.tokens_decoded = 0
        self.chars_scanned = 0

    def _tail(self, token_ids: list[int], end: int) -> str:
        self.tokens_decoded += end - self.prefix_offset
        return self.tokenizer.decode(token_ids[self.prefix_offset:end], skip_special_tokens=self.skip_special_tokens)

    def step(self, token_ids: list[int], check_stop: bool = True) -> bool:
        """Take the output so far (one new token since the last call); extend `text`.
        Returns True when a stop string matched (`text` then ends before it); with
        check_stop=False (before min_tokens) none is looked for in this token's text."""
        prefix = self._tail(token_ids, self.read_offset)
        full = self._tail(token_ids, len(token_ids))
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # nothing printable yet (a half-decoded character)
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return self._append(new, check_stop)

    def flush(self, token_ids: list[int]) -> None:
        """At the end: emit whatever is held back, a partial character included."""
        prefix = self._tail(token_ids, self.read_offset)
        full = self._tail(token_ids, len(token_ids))
        if len(full) > len(prefix):
            self._append(full[len(prefix):])
        self.prefix_offset = self.read_offset = len(token_ids)

    def _append(self, new: str, check_stop: bool = True) -> bool:
        old = len(self.text)
        self.text += new
        if not self.stop or not check_stop:
            return False
        # A match must end in the new text: scan from max_stop - 1 characters before it.
        lo = max(0, old - self.max_stop + 1)
        self.chars_scanned += (len(self.text) - lo) * len(self.stop)
        hits = [(i, -len(s)) for i, s in ((self.text.find(s, lo), s) for s in self.stop) if i >= 0]
        if not hits:
            return False
        at, minus_len = min(hits)  # the first match; of those starting there, the longest
        self.text = self.text[: at - minus_len if self.include_stop else at]
        return True
