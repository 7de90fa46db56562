"""Passkey retrieval prompts: a number hidden at a chosen depth in repetitive filler."""
from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
          "Here we go. There and back again. ")


@dataclass
class PasskeyPrompt:
    messages: list[dict[str, str]]
    answer: str
    depth: float


def passkey_prompt(tokenizer, num_tokens: int, depth: float, seed: int = 0,
                   filler: str = FILLER) -> PasskeyPrompt:
    """Chat prompt of about `num_tokens` tokens with the passkey at `depth` (0..1) of the filler."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    head = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
            "memorize it. I will quiz you about the important information there.\n\n")
    question = "\n\nWhat is the pass key?"
    fixed = len(tokenizer.encode(head + needle + question)) + 30  # chat template overhead
    per = len(tokenizer.encode(filler))
    reps = max(0, (num_tokens - fixed) // per)
    before = round(reps * depth)
    text = head + filler * before + needle + filler * (reps - before) + question
    return PasskeyPrompt([{"role": "user", "content": text}], key, depth)
