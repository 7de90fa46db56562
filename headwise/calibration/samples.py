"""Calibration data: retrieval prompts generated on the fly, with the answer appended so
one forward pass shows every head at the positions that produce the answer."""
from __future__ import annotations

import random
from dataclasses import dataclass

from headwise.evaluation import tasks


@dataclass
class CalibSample:
    sample: tasks.Sample
    ids: list[int]               # prompt + answer tokens
    query_rows: list[int]        # positions whose next token is an answer token
    needle_rows: list[int]       # token positions of the needle(s)


def _span_tokens(tokenizer, text: str, needle: str) -> list[int]:
    start = text.index(needle)
    a = len(tokenizer.encode(text[:start]))
    b = len(tokenizer.encode(text[: start + len(needle)]))
    return list(range(max(0, a - 1), b))


def make_samples(tokenizer, num: int, lengths: tuple[int, ...], seed: int) -> list[CalibSample]:
    """`num` samples over task formats (passkey, prose needle, multi-key), lengths and depths."""
    rng = random.Random(seed)
    kinds = ["passkey", "niah", "multikey"]
    out = []
    for i in range(num):
        kind = kinds[i % len(kinds)]
        length = lengths[(i // len(kinds)) % len(lengths)]
        depth = (i * 0.37 + rng.random() * 0.2) % 1.0
        s = tasks.TASKS[kind](tokenizer, length, depth, seed=rng.randrange(1 << 30))
        prompt = tokenizer.encode(s.text)
        answer = tokenizer.encode(" " + s.answers[0] + ".", add_special_tokens=False)
        ids = prompt + answer
        rows = list(range(len(prompt) - 1, len(ids) - 1))
        needle = [r for n in s.needles[:1] for r in _span_tokens(tokenizer, s.text, n)]
        out.append(CalibSample(s, ids, rows, needle))
    return out
