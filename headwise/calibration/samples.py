"""Calibration data: retrieval prompts generated on the fly, with the answer appended so
one forward pass shows every head at the positions that produce the answer.

Held out from the quality suite (evaluation.families): the haystacks come from the
"calib" sources of evaluation.sources (GNU Info manuals, Debian package READMEs), never
the suite's, and the needles from CALIB_TEMPLATES, none of which the suite uses. Kinds:
number needles, phrase needles (the answer is copied words), several needles with one
asked for, (opt-in, `codes`) six needles whose keys and values are random serial codes,
one asked for, so a head that copies an unseen string from far back shows it, and
(opt-in, `tally`) a count over the whole prompt: one traveller's trips
scattered through the text, the city named most often asked for, so a head that must
see every mention to answer shows it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from headwise.evaluation import tasks
from headwise.evaluation.sources import CALIB_SOURCES

PLACES = ["Ankara", "Beirut", "Caracas", "Dhaka", "Entebbe", "Fukuoka", "Geneva", "Havana", "Izmir",
          "Jakarta", "Kigali", "Leipzig", "Malmo", "Nantes", "Oaxaca", "Porto", "Riga", "Sapporo", "Tbilisi",
          "Utrecht"]
PEOPLE = ["Aurelio", "Beatrix", "Cosmin", "Delphine", "Emeka", "Fenna", "Gustavo", "Halima", "Ivo", "Jelena",
          "Kasimir", "Leonie", "Marek", "Noor", "Olivier", "Pavla", "Quentin", "Rosalind", "Stellan", "Teodora"]
DISHES = ["a lentil soup with smoked paprika", "baked pears with honey and walnuts",
          "a pie of leeks and potatoes", "grilled sardines with lemon", "a stew of beans and chestnuts",
          "rice pudding with cardamom", "a cake of carrots and almonds", "roasted peppers stuffed with barley"]
CUSTOMS = ["fly paper lanterns from the bridges", "play chess in the railway station",
           "bake bread in the communal ovens", "sing in the tunnels under the market",
           "paint the doors of their houses blue", "race wooden boats in the canals"]
# (needle, question ending in the start of its answer); {k} key, {v} value.
NUMBER_TEMPLATES = [
    ("The secret code for the {k} vault is {v}.", "What is the secret code for the {k} vault? "
                                                  "The secret code for the {k} vault is"),
    ("{k} keeps the spare key in box number {v}.", "In which box does {k} keep the spare key? "
                                                   "{k} keeps the spare key in box number"),
]
PHRASE_TEMPLATES = [
    ("The dish that {k} is famous for is {v}.", "What dish is {k} famous for? The dish that {k} is famous for is"),
    ("When it rains in {k}, people like to {v}.", "What do people in {k} like to do when it rains? "
                                                  "When it rains in {k}, people like to"),
]
TALLY_TEMPLATES = [
    ("{k} took the night train to {v}.", "Which city did {k} take the night train to most often? "
                                         "The city {k} took the night train to most often is"),
]
CODE_TEMPLATES = [
    ("The crate stamped {k} contains spare part {v}.", "Which spare part does the crate stamped {k} contain? "
                                                       "The crate stamped {k} contains spare part"),
]
CALIB_TEMPLATES = [t for pair in NUMBER_TEMPLATES + PHRASE_TEMPLATES + TALLY_TEMPLATES + CODE_TEMPLATES
                   for t in pair]
HEAD = "Below is some documentation. A few facts are hidden in it; remember them.\n\n"
KINDS = ("number", "phrase", "distractors")  # the default mix (every shipped layout's)
ALL_KINDS = KINDS + ("tally", "codes")
# tally: trips to each of five cities; the first is the answer, named more often than any other
TALLY_COUNTS = (5, 3, 2, 2, 1)
CODE_NEEDLES = 6  # codes: crates in one prompt


def serial_code(rng: random.Random) -> str:
    """A random serial code, "KQ7-4821-MZT" (not the suite's UUIDs: another shape)."""
    letters, digits = "ABCDEFGHJKLMNPQRSTUVWXYZ", "0123456789"
    return "-".join("".join(rng.choice(pool) for _ in range(n))
                    for pool, n in ((letters + digits, 3), (digits, 4), (letters, 3)))


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


def calib_prompt(tokenizer, kind: str, length: int, depth: float, seed: int) -> tasks.Sample:
    """One calibration prompt of `kind` (ALL_KINDS) at `depth`, in a calibration source."""
    rng = random.Random(seed)
    source = CALIB_SOURCES[seed % len(CALIB_SOURCES)]
    check_kinds((kind,))
    if kind == "tally":
        needle, q = TALLY_TEMPLATES[0]
        k = rng.choice(PEOPLE)
        cities = rng.sample(PLACES, len(TALLY_COUNTS))
        trips = [c for c, m in zip(cities, TALLY_COUNTS) for _ in range(m)]
        # `depth` places the answer's first mention; every other trip lands anywhere
        depths = [depth] + [rng.random() for _ in trips[1:]]
        needles, answer = [(d, needle.format(k=k, v=c)) for d, c in zip(depths, trips)], cities[0]
    elif kind == "phrase":
        t = rng.randrange(len(PHRASE_TEMPLATES))
        needle, q = PHRASE_TEMPLATES[t]
        k = rng.choice(PEOPLE if t == 0 else PLACES)
        v = rng.choice(DISHES if t == 0 else CUSTOMS)
        needles, answer = [(depth, needle.format(k=k, v=v))], v
    else:  # number, distractors, codes: needles of keys and values, the first asked
        if kind == "codes":
            needle, q = CODE_TEMPLATES[0]
            keys = [serial_code(rng) for _ in range(CODE_NEEDLES)]
            values = [serial_code(rng) for _ in keys]
        else:
            t = rng.randrange(len(NUMBER_TEMPLATES))
            needle, q = NUMBER_TEMPLATES[t]
            keys = rng.sample(PLACES if t == 0 else PEOPLE, 3 if kind == "distractors" else 1)
            values = [str(rng.randint(1000, 999999)) for _ in keys]
        depths = [depth] + [rng.random() for _ in keys[1:]]
        needles = [(d, needle.format(k=k, v=v)) for d, k, v in zip(depths, keys, values)]
        k, answer = keys[0], values[0]
    needles = [(d, f" {n} ") for d, n in needles]
    text = tasks._build(tokenizer, length, source, HEAD, needles, "\n\n" + q.format(k=k), seed)
    return tasks.Sample(kind, text, [answer], depth, length, [n for _, n in needles])


def check_kinds(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """`kinds` if it names one or more of ALL_KINDS and nothing else; else ValueError."""
    bad = [k for k in kinds if k not in ALL_KINDS]
    if not kinds or bad:
        raise ValueError(f"calibration kinds must be some of {', '.join(ALL_KINDS)}, got {', '.join(kinds) or 'none'}")
    return kinds


def make_samples(tokenizer, num: int, lengths: tuple[int, ...], seed: int,
                 kinds: tuple[str, ...] = KINDS) -> list[CalibSample]:
    """`num` samples over the kinds, lengths and depths (deterministic for a seed)."""
    check_kinds(kinds)
    rng = random.Random(seed)
    out = []
    for i in range(num):
        kind = kinds[i % len(kinds)]
        length = lengths[(i // len(kinds)) % len(lengths)]
        depth = (i * 0.37 + rng.random() * 0.2) % 1.0
        s = calib_prompt(tokenizer, kind, length, depth, seed=rng.randrange(1 << 30))
        prompt = tokenizer.encode(s.text)
        answer = tokenizer.encode(" " + s.answers[0] + ".", add_special_tokens=False)
        ids = prompt + answer
        rows = list(range(len(prompt) - 1, len(ids) - 1))
        needle = [r for n in s.needles[:1] for r in _span_tokens(tokenizer, s.text, n)]
        out.append(CalibSample(s, ids, rows, needle))
    return out
