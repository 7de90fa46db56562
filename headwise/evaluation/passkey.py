"""Passkey retrieval prompts: a number hidden at a chosen depth in repetitive filler.

Plain completion format ("... What is the pass key? The pass key is"): SmolLM2-135M
answers it with full attention up to 8K tokens, while the same text wrapped in the chat
template mostly makes it describe what a pass key is.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
          "Here we go. There and back again. ")
HEAD = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about the important information there.\n\n")
QUESTION = "\n\nWhat is the pass key mentioned in the text above? The pass key is"


@dataclass
class PasskeyPrompt:
    text: str
    answer: str
    depth: float


def passkey_prompt(tokenizer, num_tokens: int, depth: float, seed: int = 0,
                   filler: str = FILLER) -> PasskeyPrompt:
    """Prompt of about `num_tokens` tokens with the passkey at `depth` (0..1) of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = len(tokenizer.encode(HEAD + needle + QUESTION))
    per = len(tokenizer.encode(filler * 8)) / 8
    reps = max(0, round((num_tokens - fixed) / per))
    before = round(reps * depth)
    text = HEAD + filler * before + needle + filler * (reps - before) + QUESTION
    return PasskeyPrompt(text, key, depth)
