"""Structured outputs: what a request constrains its output to (JSON schema, any JSON
object, regex, one of several strings, a grammar), validated and turned into an
llguidance grammar. Plain and picklable: a Ray replica receives it inside SamplingParams;
the engine compiles it into a matcher (engine/grammar.py).

llguidance was chosen over xgrammar by measurement on SmolLM2's 49K vocabulary (notes in
docs/structured_outputs.md): a mask per token 0.04 ms against 0.17 ms, a schema compiled
lazily in about 1 ms against 6-21 ms, and no dependencies (xgrammar pulls triton and
apache-tvm-ffi into a CPU install).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from headwise.errors import InvalidParameterError

# Compact separators: a small model let loose in flexible JSON whitespace can spend its
# whole budget on newlines (vLLM's `disable_any_whitespace` exists for the same reason).
_JSON_DEFAULTS = {"whitespace_flexible": False}
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint (vLLM's StructuredOutputsParams):
    json: a JSON schema (dict or its JSON text); json_object: any JSON object;
    regex: a regular expression (Rust regex syntax, matched in full);
    choice: the output is one of these strings; grammar: Lark or GBNF (llama.cpp) text.
    `param`: the request field it came from, named in errors (e.g. response_format)."""
    json: dict | str | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameterError(self.param, f"{self.param}: give exactly one of json, json_object, "
                                        f"regex, choice, grammar (got {given or 'none'})")
        try:
            err = llguidance.LLMatcher.validate_grammar(self.lark())
        except ValueError as e:  # llguidance's own refusal of the text (e.g. a GBNF without root)
            err = str(e)
        if err:
            raise InvalidParameterError(self.param, f"{self.param}: invalid {self.kind}: {err.strip()}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A stable text naming the constraint (compiled matchers are cached by it)."""
        value = getattr(self, self.kind)
        return f"{self.kind}:{json.dumps(value, sort_keys=True) if not isinstance(value, str) else value}"

    def lark(self) -> str:
        """The llguidance grammar (its JSON envelope over a schema, regex or Lark text)."""
        kind = self.kind
        if kind in ("json", "json_object"):
            schema = self.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                try:
                    json.loads(schema)
                except ValueError as e:
                    raise InvalidParameterError(self.param, f"{self.param}: the schema is not JSON: {e}") from None
            else:
                schema = json.dumps(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidParameterError(self.param, f"{self.param}: choice must be a non-empty list "
                                            "of non-empty strings")
            return llguidance.grammar_from("choice", json.dumps(list(self.choice)))
        return llguidance.grammar_from("grammar", self.grammar)
