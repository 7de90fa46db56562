"""Long-context task generators (seeded, no downloads) and their scorers.

Every generator returns a Sample whose prompt is within 2% of the requested token count
and whose needle sits at the requested depth (fraction of the haystack before it).
Haystacks are either the classic passkey filler or English prose from one of the sources
in evaluation.sources (by default the license texts Debian ships in every installation).
The quality suite's families (evaluation.families) build on these pieces.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from headwise.evaluation import sources
from headwise.evaluation.passkey import FILLER

CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quito", "Dublin", "Cairo", "Perth", "Zagreb",
          "Bogota", "Tallinn", "Accra", "Osaka", "Seville", "Bergen", "Tunis", "Manila", "Lyon", "Krakow"]
WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "forest", "rocket",
         "silver", "garden", "window", "planet", "violin", "harbor", "marble", "falcon", "meadow", "copper",
         "anchor", "basket", "castle", "dragon", "engine", "feather", "glacier", "helmet", "island", "jacket"]


@dataclass
class Sample:
    task: str
    text: str
    answers: list[str]          # every expected answer string
    depth: float | None = None
    length: int = 0             # requested length in tokens
    needles: list[str] = field(default_factory=list)  # needle sentences, for calibration


def prose_sentences(source: str = "licenses") -> list[str]:
    """Sentences of English prose from a haystack source (evaluation.sources), in order."""
    return list(sources.sentences(source))


class Haystack:
    """Pieces of filler with known token counts, cut to a token budget."""

    def __init__(self, tokenizer, pieces: list[str]) -> None:
        self.pieces = pieces
        self.counts = [len(tokenizer.encode(p, add_special_tokens=False)) for p in pieces]

    def take(self, num_tokens: int, start: int = 0) -> list[str]:
        out, total, i = [], 0, start
        n = len(self.pieces)
        while total < num_tokens:
            out.append(self.pieces[i % n])
            total += self.counts[i % n]
            i += 1
        return out


_HAYSTACKS: dict[tuple[int, str], Haystack] = {}


def haystack(tokenizer, kind: str) -> Haystack:
    """The pieces of `kind`: "filler" (the passkey filler), "prose" (the license texts)
    or the name of a source in evaluation.sources."""
    key = (id(tokenizer), kind)
    if key not in _HAYSTACKS:
        if kind == "filler":
            pieces = [s + ". " for s in FILLER.split(". ") if s.strip()]
        else:
            pieces = prose_sentences("licenses" if kind == "prose" else kind)
        _HAYSTACKS[key] = Haystack(tokenizer, pieces)
    return _HAYSTACKS[key]


def _build(tokenizer, num_tokens: int, kind: str, head: str, needles: list[tuple[float, str]],
           question: str, seed: int) -> str:
    """Haystack of `kind` with each needle inserted at its depth, sized to num_tokens."""
    hs = haystack(tokenizer, kind)
    start = random.Random(seed).randrange(len(hs.pieces)) if kind != "filler" else 0
    n = len(hs.pieces)

    def make(budget: float) -> str:
        kept, cum, total, i = [], [0], 0, start
        while total + hs.counts[i % n] <= budget:
            kept.append(hs.pieces[i % n])
            total += hs.counts[i % n]
            cum.append(total)
            i += 1
        # Fill the remainder with the first words of the next piece (prose sentences are
        # long; whole pieces alone would miss the target by up to a sentence).
        words = hs.pieces[i % n].split()
        k = int((budget - total) / max(1.0, hs.counts[i % n] / max(1, len(words))))
        if k > 0:
            kept.append(" ".join(words[:k]) + " ")
            total = budget
            cum.append(total)
        # Needles go at the piece boundary nearest their depth in tokens, deepest first
        # so earlier insertions do not shift later ones.
        for depth, needle in sorted(needles, key=lambda x: -x[0]):
            kept.insert(min(range(len(cum)), key=lambda j: abs(cum[j] - depth * total)), needle)
        return head + "".join(kept) + question

    return _fit(tokenizer, num_tokens, make)


def _fit(tokenizer, num_tokens: int, make) -> str:
    """Call make(budget) with budgets corrected until the prompt is within 1% of num_tokens
    (pieces tokenize slightly differently alone and in context)."""
    budget = float(num_tokens)
    best = None
    for _ in range(6):
        text = make(budget)
        got = len(tokenizer.encode(text))
        if best is None or abs(got - num_tokens) < abs(best[1] - num_tokens):
            best = (text, got)
        if abs(got - num_tokens) <= 0.01 * num_tokens:
            break
        budget += num_tokens - got
    return best[0]


def passkey(tokenizer, num_tokens: int, depth: float, seed: int = 0) -> Sample:
    from headwise.evaluation.passkey import HEAD, QUESTION

    key = str(random.Random(seed).randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    text = _build(tokenizer, num_tokens, "filler", HEAD, [(depth, needle)], QUESTION, seed)
    return Sample("passkey", text, [key], depth, num_tokens, [needle])


def niah(tokenizer, num_tokens: int, depth: float, seed: int = 0) -> Sample:
    """A fact in real prose: 'The special magic number for <city> is <n>.'"""
    rng = random.Random(seed)
    city, num = rng.choice(CITIES), str(rng.randint(100000, 999999))
    needle = f" The special magic number for {city} is {num}. "
    head = "Read the following text carefully; a special magic number is hidden in it.\n\n"
    q = f"\n\nWhat is the special magic number for {city} mentioned in the text above? The special magic number for {city} is"
    text = _build(tokenizer, num_tokens, "prose", head, [(depth, needle)], q, seed)
    return Sample("niah", text, [num], depth, num_tokens, [needle])


def multikey(tokenizer, num_tokens: int, depth: float, seed: int = 0, keys: int = 4) -> Sample:
    """RULER multi-key NIAH: several city -> number facts; ask for one of them."""
    rng = random.Random(seed)
    cities = rng.sample(CITIES, keys)
    nums = [str(rng.randint(100000, 999999)) for _ in cities]
    needles = [f" The special magic number for {c} is {n}. " for c, n in zip(cities, nums)]
    depths = [depth] + [rng.random() for _ in cities[1:]]
    head = "Read the following text carefully; special magic numbers for several cities are hidden in it.\n\n"
    q = (f"\n\nWhat is the special magic number for {cities[0]} mentioned in the text above? "
         f"The special magic number for {cities[0]} is")
    text = _build(tokenizer, num_tokens, "prose", head, list(zip(depths, needles)), q, seed)
    return Sample("multikey", text, [nums[0]], depth, num_tokens, [needles[0]])


def variable_tracking(tokenizer, num_tokens: int, depth: float, seed: int = 0, hops: int = 3,
                      kind: str = "filler") -> Sample:
    """RULER variable tracking: VAR A = n, VAR B = VAR A, ...; name every variable equal to n
    (in a haystack of `kind`, see haystack())."""
    rng = random.Random(seed)
    names = ["".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(hops + 1)]
    value = str(rng.randint(10000, 99999))
    chain = [f" VAR {names[0]} = {value}. "] + [f" VAR {names[i + 1]} = VAR {names[i]}. " for i in range(hops)]
    depths = sorted([depth] + [rng.uniform(depth, 1.0) for _ in range(hops)])
    head = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
    q = (f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above. "
         f"Answer: According to the chain of variable assignments, the variables assigned the value {value} are:")
    text = _build(tokenizer, num_tokens, kind, head, list(zip(depths, chain)), q, seed)
    return Sample("vartrack", text, names, depth, num_tokens, chain)


def common_words(tokenizer, num_tokens: int, depth: float = 0.0, seed: int = 0, top: int = 3) -> Sample:
    """RULER common-word extraction: a numbered word list where `top` words repeat most."""
    rng = random.Random(seed)
    common = rng.sample(WORDS, top)
    rare = [w for w in WORDS if w not in common]
    head = "Below is a numbered list of words. In these words, some appear more often than others.\n\n"
    q = (f"\n\nQuestion: What are the {top} most common words in the above list? "
         f"Answer: The top {top} words that appear most often in the list are:")
    order = [rng.random() for _ in range(100000)]

    def make(budget: float) -> str:
        n = max(top * 4, int(budget / 5.5))
        words = [common[i % top] for i in range(n // 4)] + [rare[int(order[i] * len(rare))] for i in range(n - n // 4)]
        random.Random(seed).shuffle(words)
        return head + " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)) + q

    text = _fit(tokenizer, num_tokens, make)
    return Sample("cwe", text, common, None, num_tokens, [])


TASKS = {"passkey": passkey, "niah": niah, "multikey": multikey, "vartrack": variable_tracking,
         "cwe": common_words}
RULER_TASKS = ("multikey", "vartrack", "cwe")


def score(sample: Sample, output: str) -> float:
    """Fraction of expected answers present in the output (1.0 / 0.0 for single answers)."""
    out = output.lower()
    hits = sum(a.lower() in out for a in sample.answers)
    return hits / len(sample.answers)
