"""SamplingParams: validated per-request sampling settings."""
from __future__ import annotations

from dataclasses import dataclass, field


GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0       # 0 (or below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1 means no limit
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None    # None: none; 0: chosen token only; k: plus top-k

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
             and self.max_tokens >= 1, f"must be an integer >= 1, got {self.max_tokens!r}"),
            ("temperature", _is_num(self.temperature) and self.temperature >= 0,
             f"must be >= 0, got {self.temperature!r}"),
            ("top_p", _is_num(self.top_p) and 0 < self.top_p <= 1,
             f"must be in (0, 1], got {self.top_p!r}"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= -1,
             f"must be -1, 0 (no limit) or a positive integer, got {self.top_k!r}"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                           and -(1 << 63) <= self.seed < (1 << 64)),
             f"must be an integer that fits 64 bits, got {self.seed!r}"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"must be an integer in [0, 20], got {self.logprobs!r}"),
            ("stop", all(isinstance(s, str) and s for s in self.stop),
             "must be a non-empty string or a list of non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be a list of non-negative integers"),
        ]
        for name, ok, msg in checks:
            if not ok:
                raise InvalidParameterError(name, f"{name} {msg}")

    @property
    def greedy(self) -> bool:
        # Dividing logits by a temperature this small overflows them (vLLM's threshold).
        return self.temperature < GREEDY_BELOW


class InvalidParameterError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
