"""What a request must be before the engine takes it: token ids inside the vocabulary,
sampling parameters the engine can honour, a prompt that fits the context. Shared by the
engine, LLM and the server (which turns these errors into 400 responses)."""
from __future__ import annotations

from headwise.errors import InvalidParameterError
from headwise.sampling import SamplingParams


class PromptTooLongError(ValueError):
    pass


def check_token_ids(prompt: object, vocab_size: int) -> list[int]:
    if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
        raise TypeError("a prompt must be a string or a list of token ids")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")
    return list(prompt)


def check_params(params: SamplingParams, vocab_size: int) -> None:
    if params.n != 1:
        raise InvalidParameterError("n", "the engine takes one choice per sequence; use LLM.generate or "
                                    "the server for n > 1 (SamplingParams.for_choice)")
    for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids),
                      ("allowed_token_ids", params.allowed_token_ids or [])):
        far = [t for t in ids if t >= vocab_size]
        if far:
            raise InvalidParameterError(name, f"{name}: token id {far[0]} is outside the vocabulary "
                                        f"(size {vocab_size})")


def check_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens == 0:
        raise PromptTooLongError("the prompt is empty")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens, but the "
            f"request asks for {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
            f"the prompt, {max_tokens} for the completion)"
        )
