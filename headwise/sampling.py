"""SamplingParams: validated per-request sampling settings."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from headwise.errors import InvalidParameterError
from headwise.structured import StructuredOutputs

GREEDY_BELOW = 1e-5
MAX_N = 128
# vLLM only asks for > 0; past these bounds a logit divided by the penalty overflows float32
# once a temperature divides it again (found by the server's fuzzer), so they are refused.
REPETITION_PENALTY = (0.01, 100.0)


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
    # Choices per prompt; choice i > 0 samples with seed + i when a seed is given (vLLM).
    n: int = 1
    # Choices sampled per prompt, of which the n with the highest cumulative logprob are
    # returned (vLLM v0's and OpenAI's best_of); None: n.
    best_of: int | None = None
    min_p: float = 0.0             # drop tokens whose probability is below min_p x the top one's
    # vLLM's penalties: presence / frequency subtract from the logits of tokens already
    # generated (once / per occurrence); repetition divides positive logits (multiplies
    # negative ones) of tokens in the prompt or the output; 1 is off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0            # no EOS, stop token or stop string before this many tokens
    structured_outputs: StructuredOutputs | None = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids); None: any.
    allowed_token_ids: list[int] | None = None
    # Words the output may not contain (vLLM's bad_words): the last token of each, as the
    # engine tokenizes it at the start of a word and after a space, is banned wherever the
    # output ends with the tokens before it.
    bad_words: list[str] | None = None
    # A matched stop string, or the stop token's text, stays at the end of the output
    # (vLLM's semantics: by default neither is in it).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # special tokens left out of the output text
    # Log-probabilities of the prompt's tokens (each given the ones before it) plus the top
    # k at each position (vLLM's prompt_logprobs); None: not computed. Such a request
    # computes its whole prompt: a cached prefix has no logits to give.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise InvalidParameterError("logit_bias", "logit_bias must map token ids to biases")
        bias = self.logit_bias or {}
        if isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        if isinstance(self.allowed_token_ids, (tuple, set, frozenset)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        allowed = self.allowed_token_ids
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
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
             f"must be an integer in [0, 20], got {self.logprobs!r}"),
            ("prompt_logprobs", self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                                 and 0 <= self.prompt_logprobs <= 20),
             f"must be an integer in [0, 20], got {self.prompt_logprobs!r}"),
            ("stop", all(isinstance(s, str) and s for s in self.stop),
             "must be a non-empty string or a list of non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be a list of non-negative integers"),
            ("n", _is_int(self.n) and 1 <= self.n <= MAX_N, f"must be an integer in [1, {MAX_N}], got {self.n!r}"),
            ("best_of", self.best_of is None or (_is_int(self.best_of) and _is_int(self.n)
                                                 and self.n <= self.best_of <= MAX_N),
             f"must be an integer in [n, {MAX_N}], got {self.best_of!r}"),
            ("min_p", _is_num(self.min_p) and 0 <= self.min_p <= 1, f"must be in [0, 1], got {self.min_p!r}"),
            ("presence_penalty", _is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"must be in [-2, 2], got {self.presence_penalty!r}"),
            ("frequency_penalty", _is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"must be in [-2, 2], got {self.frequency_penalty!r}"),
            ("repetition_penalty", _is_num(self.repetition_penalty)
             and REPETITION_PENALTY[0] <= self.repetition_penalty <= REPETITION_PENALTY[1],
             f"must be in [{REPETITION_PENALTY[0]}, {REPETITION_PENALTY[1]}], got {self.repetition_penalty!r}"),
            ("logit_bias", all(_is_int(t) and t >= 0 and _is_num(b) and -100 <= b <= 100 for t, b in bias.items()),
             "must map non-negative token ids to numbers in [-100, 100]"),
            ("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             f"must be an integer in [0, max_tokens], got {self.min_tokens!r}"),
            ("allowed_token_ids", allowed is None or (isinstance(allowed, list) and len(allowed) > 0
                                                      and all(_is_int(t) and t >= 0 for t in allowed)),
             "must be a non-empty list of non-negative token ids"),
            ("bad_words", self.bad_words is None or (isinstance(self.bad_words, list)
                                                     and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
             "must be a list of words (non-blank strings)"),
            ("include_stop_str_in_output", isinstance(self.include_stop_str_in_output, bool), "must be a boolean"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "must be a boolean"),
            ("structured_outputs", self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputs), "must be a StructuredOutputs"),
        ]
        for name, ok, msg in checks:
            if not ok:
                raise InvalidParameterError(name, f"{name} {msg}")
        if self.choices > self.n and self.greedy:
            raise InvalidParameterError("best_of", "best_of > n needs sampling (temperature > 0): "
                                        "greedy choices would all be the same")

    @property
    def greedy(self) -> bool:
        # Dividing logits by a temperature this small overflows them (vLLM's threshold).
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def choices(self) -> int:
        """Choices sampled per prompt: best_of where given, else n."""
        return self.n if self.best_of is None else self.best_of

    def for_choice(self, i: int) -> "SamplingParams":
        """Choice i's own params (n = 1; seed + i when seeded, so the choices differ). The
        prompt's logprobs are computed by choice 0 only (the others use its cached prefix).
        Choices to be ranked (best_of > n) compute their tokens' logprobs."""
        seed = self.seed if self.seed is None or i == 0 else (self.seed + i) % (1 << 64)
        ranked = self.choices > self.n and self.logprobs is None
        return replace(self, n=1, best_of=None, seed=seed, logprobs=0 if ranked else self.logprobs,
                       prompt_logprobs=self.prompt_logprobs if i == 0 else None)

    def best(self, cumulative_logprobs: list[float]) -> list[int]:
        """Which of the choices are returned, best first where ranked (best_of > n): the n
        with the highest cumulative logprob; else all, in order."""
        order = range(len(cumulative_logprobs))
        if self.choices == self.n:
            return list(order)
        return sorted(order, key=lambda i: -cumulative_logprobs[i])[:self.n]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
