"""The quality suite's task families: prompt builders (seeded) and what they expect.

Every family is asked at several depths and seeds per length. The seed picks the haystack
source (the three "eval" sources of evaluation.sources in turn), the phrasing (one of
three templates) and the names and values. Calibration (calibration.samples) uses other
sources and other templates: CALIB_TEMPLATES there, EVAL_TEMPLATES here, never the same
(tests/test_quality_suite.py asserts both).

Scoring (tasks.score): the fraction of the expected strings found in the output, case
folded. Phrase and span answers expect their content words, so a copied phrase scores 1
and a paraphrase with other words scores less. A prompt passes when it scores 1.
"""
from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from headwise.evaluation import tasks
from headwise.evaluation.sources import EVAL_SOURCES, sentences

NAMES = ["Amara", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ines", "Jonas",
         "Kofi", "Lucia", "Mateo", "Nadia", "Oskar", "Priya", "Rafael", "Sofia", "Tomas", "Yara"]
ACTIVITIES = ["eat a sandwich and sit in the park on a sunny day", "walk along the old harbour at sunset",
              "visit the little bookshop behind the cathedral", "take the night ferry across the bay",
              "climb the clock tower before breakfast", "listen to the street musicians by the fountain",
              "ride the tram to the end of the line", "drink mint tea in the covered market",
              "watch the fishing boats come in at dawn", "rent a bicycle and follow the river path",
              "swim in the cold lake behind the hills", "dance in the square on Friday evenings"]
HOBBIES = ["carving wooden owls", "collecting antique keys", "restoring old typewriters",
           "painting tiny lighthouses", "building paper kites", "growing purple tomatoes",
           "knitting striped scarves for penguins", "juggling glass oranges", "repairing pocket watches",
           "photographing rusty bicycles", "baking lavender bread", "writing letters in invisible ink"]
COLORS = ["amber", "crimson", "emerald", "indigo", "ivory", "scarlet", "cobalt", "olive", "violet", "bronze"]
STOPWORDS = {"a", "an", "the", "and", "or", "of", "in", "on", "at", "to", "by", "for", "with", "from",
             "is", "are", "be", "it", "its", "as", "that", "this", "behind", "before", "across", "along"}

# Number needles: (needle, question ending in the start of its answer); {k} key, {v} value.
NUMBER_TEMPLATES = [
    ("The special magic number for {k} is {v}.",
     "What is the special magic number for {k} mentioned in the text above? The special magic number for {k} is"),
    ("Remember this: the access code of the {k} office is {v}.",
     "What is the access code of the {k} office? The access code of the {k} office is"),
    ("For the record, the locker number assigned to {k} is {v}.",
     "Which locker number is assigned to {k}? The locker number assigned to {k} is"),
]
PHRASE_TEMPLATES = [
    ("The best thing to do in {k} is to {v}.",
     "What is the best thing to do in {k}? The best thing to do in {k} is to"),
    ("Few people know that {k}'s secret hobby is {v}.",
     "What is {k}'s secret hobby? {k}'s secret hobby is"),
    ("The password that opens the {k} gate is {v}.",
     "What is the password that opens the {k} gate? The password that opens the {k} gate is"),
]
MULTIVALUE_TEMPLATES = [
    ("One of the special magic numbers for {k} is {v}.",
     "What are all the special magic numbers for {k} mentioned in the text above? "
     "The special magic numbers for {k} are"),
    ("One of the codes stored in the {k} archive is {v}.",
     "What are all the codes stored in the {k} archive? The codes stored in the {k} archive are"),
    ("A ticket sold to {k} carries the number {v}.",
     "What numbers do the tickets sold to {k} carry? The tickets sold to {k} carry the numbers"),
]
MULTIQUERY_QUESTIONS = [
    "What are the special magic numbers for {ks} mentioned in the text above? The special magic numbers are",
    "What are the access codes of the {ks} offices? The access codes are",
    "Which locker numbers are assigned to {ks}? The locker numbers are",
]
# Random-string needles: a UUID key filed with a UUID value, copied back character for
# character (RULER's niah_multikey_3 keys and values, in our own phrasing and in prose).
UUID_TEMPLATES = [
    ("The archive entry labelled {k} holds the reference {v}.",
     "What reference does the archive entry labelled {k} hold? The archive entry labelled {k} holds the reference"),
    ("Shipment {k} was forwarded under the tracking id {v}.",
     "Under which tracking id was shipment {k} forwarded? Shipment {k} was forwarded under the tracking id"),
    ("The badge issued for {k} encodes the token {v}.",
     "Which token does the badge issued for {k} encode? The badge issued for {k} encodes the token"),
]
HEAD = "Read the following text carefully; some facts are hidden in it. Answer the question at the end.\n\n"
EVAL_TEMPLATES = ([t for pair in NUMBER_TEMPLATES + PHRASE_TEMPLATES + MULTIVALUE_TEMPLATES + UUID_TEMPLATES
                   for t in pair]
                  + MULTIQUERY_QUESTIONS)


def content_words(text: str) -> list[str]:
    """The words of an answer phrase that carry it (no stopwords, no punctuation)."""
    return list(dict.fromkeys(w for w in re.findall(r"[a-z0-9']+", text.lower()) if w not in STOPWORDS))


def _source(seed: int) -> str:
    """Seeds 3j, 3j+1, 3j+2 take the three phrasings (seed % 3) with the three sources, the
    pairing shifted by one every block of three: nine seeds cover every pairing."""
    return EVAL_SOURCES[(seed + seed // 3) % len(EVAL_SOURCES)]


def _rng(seed: int, length: int) -> random.Random:
    # names and values differ across lengths for the same seed
    return random.Random(seed * 7919 + length)


def _number(rng: random.Random) -> str:
    return str(rng.randint(100000, 999999))


def _keys(template: int, rng: random.Random, n: int) -> list[str]:
    pool = tasks.CITIES if template != 2 else NAMES
    return rng.sample(pool, n)


def _number_needles(rng: random.Random, t: int, keys: int, depth: float):
    """`keys` number needles of template t: (keys, values, [(depth, needle)]); the first at
    `depth`, the others at random depths."""
    ks = _keys(t, rng, keys)
    vs = [_number(rng) for _ in ks]
    depths = [depth] + [rng.random() for _ in ks[1:]]
    return ks, vs, [(d, _needle(NUMBER_TEMPLATES[t][0].format(k=k, v=v))) for d, k, v in zip(depths, ks, vs)]


def _sample(family: str, tok, length: int, depth: float, seed: int, needles: list[tuple[float, str]],
            question: str, answers: list[str], source: str) -> tasks.Sample:
    text = tasks._build(tok, length, source, HEAD, needles, "\n\n" + question, seed)
    return tasks.Sample(family, text, answers, depth, length, [n for _, n in needles])


def _needle(text: str) -> str:
    return f" {text} "


def passkey(tok, length: int, depth: float, seed: int) -> tasks.Sample:
    return tasks.passkey(tok, length, depth, seed)


def number(tok, length: int, depth: float, seed: int) -> tasks.Sample:
    """One number in prose, asked for by its key."""
    rng = _rng(seed, length)
    t = seed % 3
    needle, q = NUMBER_TEMPLATES[t]
    k, v = _keys(t, rng, 1)[0], _number(rng)
    return _sample("number", tok, length, depth, seed, [(depth, _needle(needle.format(k=k, v=v)))],
                   q.format(k=k), [v], _source(seed))


def phrase(tok, length: int, depth: float, seed: int) -> tasks.Sample:
    """A sentence whose answer is copied words (an activity, a hobby, a three-word password)."""
    rng = _rng(seed, length)
    t = seed % 3
    needle, q = PHRASE_TEMPLATES[t]
    if t == 0:
        k, v = rng.choice(tasks.CITIES), rng.choice(ACTIVITIES)
    elif t == 1:
        k, v = rng.choice(NAMES), rng.choice(HOBBIES)
    else:
        k, v = rng.choice(COLORS), " ".join(rng.sample(tasks.WORDS, 3))
    return _sample("phrase", tok, length, depth, seed, [(depth, _needle(needle.format(k=k, v=v)))],
                   q.format(k=k), content_words(v), _source(seed))


def multikey(tok, length: int, depth: float, seed: int, keys: int = 4) -> tasks.Sample:
    """Several needles of one template with different keys; one is asked for."""
    rng = _rng(seed, length)
    t = seed % 3
    ks, vs, needles = _number_needles(rng, t, keys, depth)
    q = NUMBER_TEMPLATES[t][1].format(k=ks[0])
    return _sample("multikey", tok, length, depth, seed, needles, q, [vs[0]], _source(seed))


def uuidkey(tok, length: int, depth: float, seed: int) -> tasks.Sample:
    """Many needles of one template, keys and values random UUIDs; one asked for, its value
    to be copied back exactly. One needle per 512 tokens (at least 4), so the key must be
    told from many of the same shape."""
    rng = _rng(seed, length)
    t = seed % 3
    needle, q = UUID_TEMPLATES[t]
    n = max(4, length // 512)
    ks = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(n)]
    vs = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(n)]
    # The needles are long (two UUIDs), so the share of the others placed before the asked
    # one is its depth: then it sits at its depth in tokens, not only in prose.
    before = round(depth * (n - 1))
    depths = [depth] + [depth * rng.random() for _ in range(before)] \
        + [depth + (1 - depth) * rng.random() for _ in range(n - 1 - before)]
    needles = [(d, _needle(needle.format(k=k, v=v))) for d, k, v in zip(depths, ks, vs)]
    return _sample("uuidkey", tok, length, depth, seed, needles, q.format(k=ks[0]), [vs[0]], _source(seed))


def multivalue(tok, length: int, depth: float, seed: int, values: int = 4) -> tasks.Sample:
    """One key with several values, all asked for."""
    rng = _rng(seed, length)
    t = seed % 3
    needle, q = MULTIVALUE_TEMPLATES[t]
    k = (tasks.CITIES if t != 2 else NAMES)[rng.randrange(20)]
    vs = [_number(rng) for _ in range(values)]
    depths = [depth] + [rng.random() for _ in vs[1:]]
    needles = [(d, _needle(needle.format(k=k, v=v))) for d, v in zip(depths, vs)]
    return _sample("multivalue", tok, length, depth, seed, needles, q.format(k=k), vs, _source(seed))


def multiquery(tok, length: int, depth: float, seed: int, keys: int = 4, asked: int = 3) -> tasks.Sample:
    """Several needles; several of them asked for in one question."""
    rng = _rng(seed, length)
    t = seed % 3
    ks, vs, needles = _number_needles(rng, t, keys, depth)
    q = MULTIQUERY_QUESTIONS[t].format(ks=", ".join(ks[:asked - 1]) + " and " + ks[asked - 1])
    return _sample("multiquery", tok, length, depth, seed, needles, q, vs[:asked], _source(seed))


def vartrack(tok, length: int, depth: float, seed: int) -> tasks.Sample:
    """RULER variable tracking, the chain hidden in prose."""
    s = tasks.variable_tracking(tok, length, depth, seed, kind=_source(seed))
    s.task = "vartrack"
    return s


def cwe(tok, length: int, depth: float, seed: int) -> tasks.Sample:
    """RULER common-word extraction (depth only varies the seed: the list fills the prompt)."""
    return tasks.common_words(tok, length, seed=seed * 101 + int(depth * 100))


def fwe(tok, length: int, depth: float, seed: int, top: int = 3) -> tasks.Sample:
    """RULER frequent-word extraction: made-up words drawn with Zipf frequencies; the
    `top` most frequent are asked for."""
    rng = random.Random(seed * 101 + int(depth * 100))
    vocab = list(dict.fromkeys("".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(3))
                               for _ in range(400)))[:300]
    weights = [1.0 / (r + 1) ** 1.3 for r in range(len(vocab))]
    head = "Read the following coded text and track how often each coded word appears.\n\n"
    q = (f"\n\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the {top} "
         f"most frequently appeared words in the above coded text? Answer: According to the coded text "
         f"above, the {top} most frequently appeared words are:")
    draws = rng.choices(range(len(vocab)), weights, k=20000)

    def make(budget: float) -> str:
        n = max(top * 4, int(budget / 3.2))
        return head + " ".join(vocab[i] for i in draws[:n]) + " ...." + q

    text = tasks._fit(tok, length, make)
    return tasks.Sample("fwe", text, vocab[:top], None, length, [])


def qa(tok, length: int, depth: float, seed: int) -> tasks.Sample:
    """A short-answer question over the document itself: the sentence at `depth` is quoted
    by its first words and the answer is how it goes on (a span of the haystack)."""
    src = _source(seed)
    rng = _rng(seed, length)
    pool = sentences(src)
    for _ in range(50):
        target = pool[rng.randrange(len(pool))]
        words = target.split()
        rest = " ".join(words[6:11])
        if len(words) < 12 or not content_words(rest):
            continue
        opening = " ".join(words[:6])
        q = (f'The text above contains a sentence that begins with "{opening}". '
             f'How does that sentence go on? It goes on:')
        s = _sample("qa", tok, length, depth, seed, [(depth, _needle(target.strip()))], q, content_words(rest), src)
        if s.text.count(opening) == 2:  # the sentence once (the needle), and the question
            return s
    raise ValueError(f"no sentence of source {src!r} opens uniquely in a {length}-token haystack (seed {seed})")


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[..., tasks.Sample]   # (tokenizer, length, depth, seed) -> Sample
    max_new: int                         # tokens generated for the answer


FAMILIES = {f.name: f for f in [
    Family("passkey", passkey, 8), Family("number", number, 10), Family("phrase", phrase, 24),
    Family("multikey", multikey, 10), Family("uuidkey", uuidkey, 40), Family("multivalue", multivalue, 48),
    Family("multiquery", multiquery, 40), Family("vartrack", vartrack, 24), Family("cwe", cwe, 16),
    Family("fwe", fwe, 16), Family("qa", qa, 16),
]}
