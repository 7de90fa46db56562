"""Thin wrapper over the HF tokenizer: encoding, incremental decoding, chat template."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from headwise.errors import InvalidParameterError

log = logging.getLogger(__name__)

# Written beside a cached tokenizer once its direct load (_direct_load) was compared with
# the model's own tokenizer class: the library versions compared and whether it was the same.
DIRECT_MARK = "headwise-direct-load.json"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "sep_token", "cls_token")
# Text the two loads must agree on: prose, digits, whitespace runs, non-Latin scripts.
_PROBE = ("Hello world, the special magic number for Paris is 12345.\n\n\tIndented  two  spaces; "
          "naïve café, ünïcode 日本語 и кириллица, emoji 🙂, code: def f(x):\n    return x**2 # done\r\n")


class Tokenizer:
    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer

    @classmethod
    def from_path(cls, directory: Path, gguf_file: str | None = None,
                  cache: Path | None = None, tokenizer_type: str | None = None) -> "Tokenizer":
        """From a HF directory, or from a GGUF file's metadata. Building one from GGUF
        metadata takes seconds (13 s for Gemma 3's 262K tokens): with `cache` (a
        directory) the result is saved once per GGUF file and loaded from there after,
        straight from its tokenizer.json where that was checked to tokenize the same.
        tokenizer_type: the type AutoTokenizer would pick from the GGUF's config
        (weights.loader.TOKENIZER_TYPES), so that it need not build that config."""
        from transformers import AutoTokenizer

        if not gguf_file:
            return cls(AutoTokenizer.from_pretrained(str(directory)))
        by_type = {"tokenizer_type": tokenizer_type} if tokenizer_type else {}
        if cache is None:
            return cls(AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file, **by_type))
        gguf = (Path(directory) / gguf_file).resolve()
        st = gguf.stat()
        key = hashlib.sha256(f"{gguf}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
        saved = Path(cache) / "tokenizers" / f"{gguf.stem}-{key}"
        if saved.is_dir():
            try:
                verdict = _direct_verdict(saved)
                if verdict:
                    return cls(_direct_load(saved))
                hf = AutoTokenizer.from_pretrained(str(saved))
                if verdict is None:  # an entry written before the check, or by other versions
                    _check_direct(hf, saved)
                return cls(hf)
            except (OSError, ValueError) as e:
                log.warning("cached tokenizer %s is unreadable (%s); rebuilding it", saved, e)
        hf = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file, **by_type)
        tmp = saved.with_name(f".{saved.name}.{os.getpid()}.tmp")
        try:
            hf.save_pretrained(str(tmp))
            _check_direct(hf, tmp)
            shutil.rmtree(saved, ignore_errors=True)
            os.replace(tmp, saved)
        except OSError as e:  # a read-only cache costs time, nothing else
            log.warning("could not cache the tokenizer in %s: %s", saved, e)
            shutil.rmtree(tmp, ignore_errors=True)
        return cls(hf)

    @property
    def chat_template(self) -> str | None:
        t = getattr(self.hf, "chat_template", None)
        return t if isinstance(t, str) else None

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], options: "ChatOptions | None" = None) -> str:
        """The conversation as the model's template writes it. By default it ends with the
        assistant's turn opened (add_generation_prompt); with continue_final_message the
        last message, an assistant's, is left open for the reply to continue."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        o = options or ChatOptions()
        return self.hf.apply_chat_template(messages, tools=o.tools, tokenize=False,
                                           add_generation_prompt=o.add_generation_prompt,
                                           continue_final_message=o.continue_final_message,
                                           **o.template_kwargs)

    def fill_in_the_middle(self, prefix: str, suffix: str) -> list[int]:
        """A prompt for the text between `prefix` and `suffix`, in the model's own
        fill-in-the-middle form (Qwen2.5-Coder's <|fim_prefix|> ... <|fim_suffix|> ...
        <|fim_middle|>, or StarCoder's <fim_prefix> ...); ValueError for a model without one."""
        vocab = self.hf.get_vocab()
        for names in (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
                      ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")):
            if all(n in vocab for n in names):
                pre, suf, mid = (vocab[n] for n in names)
                return ([pre] + self.encode(prefix, add_special_tokens=False) + [suf]
                        + self.encode(suffix, add_special_tokens=False) + [mid])
        raise ValueError("this model has no fill-in-the-middle tokens, so it takes no suffix")

    def encode_chat(self, messages: list[dict[str, str]], options: "ChatOptions | None" = None) -> list[int]:
        # The template already holds the special tokens it needs.
        return self.encode(self.apply_chat_template(messages, options), add_special_tokens=False)


# apply_chat_template's own parameters: not variables a request may pass to the template.
_RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"))


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered (vLLM's chat request fields of the same names).
    template_kwargs: extra variables the template reads (e.g. Qwen3's enable_thinking);
    tools: OpenAI's function tools, for a template that shows them to the model."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict = field(default_factory=dict)
    tools: list[dict] | None = None

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidParameterError("continue_final_message", "continue_final_message needs "
                                        "add_generation_prompt=false: the last message is continued, "
                                        "not answered")
        if not isinstance(self.template_kwargs, dict) or not all(isinstance(k, str) for k in self.template_kwargs):
            raise InvalidParameterError("chat_template_kwargs", "chat_template_kwargs must map names to values")
        taken = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(self.template_kwargs))
        if taken:
            raise InvalidParameterError("chat_template_kwargs", f"chat_template_kwargs may not set {taken[0]!r}: "
                                        "it is a parameter of its own")


# ---- reloading a cached tokenizer without the Python pass over its vocabulary ----------
# transformers' own load of a saved tokenizer re-reads tokenizer.json in Python and
# rebuilds the vocabulary through the model's tokenizer class: ~4 s of Gemma 3's 4.8 s
# warm start (262K tokens). The saved tokenizer.json already holds the whole pipeline the
# class built, so the Rust tokenizer loads it directly; whether that tokenizes exactly as
# the class does is checked once per entry and library versions (_check_direct).

def _versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def _direct_verdict(saved: Path) -> bool | None:
    """The check's verdict on `saved` under these library versions; None: not checked."""
    try:
        mark = json.loads((saved / DIRECT_MARK).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(mark, dict) or mark.get("versions") != _versions():
        return None
    return mark.get("same") is True


def _check_direct(hf, saved: Path) -> None:
    """Record in `saved` whether its direct load tokenizes as `hf` does (a failing direct
    load counts as not the same), so the check runs once per entry and versions."""
    try:
        same = _same_tokenizer(hf, _direct_load(saved))
    except Exception as e:  # any failure of the direct load means: keep transformers' load
        log.info("direct tokenizer load not used: %s", e)
        same = False
    tmp = saved / f".{DIRECT_MARK}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"versions": _versions(), "same": same}))
        os.replace(tmp, saved / DIRECT_MARK)
    except OSError as e:  # a read-only cache: the check runs again next start, nothing worse
        log.info("could not record the tokenizer check in %s: %s", saved, e)


def _direct_load(saved: Path):
    """A PreTrainedTokenizerFast from saved/tokenizer.json, with the special tokens and
    chat template saved beside it."""
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((saved / "tokenizer_config.json").read_text())
    kw = {k: cfg[k] for k in _SPECIAL_KEYS if isinstance(cfg.get(k), str)}
    for k in ("extra_special_tokens", "additional_special_tokens"):
        if cfg.get(k):
            kw[k] = cfg[k]
    template = saved / "chat_template.jinja"
    if template.is_file():
        kw["chat_template"] = template.read_text()
    elif cfg.get("chat_template"):
        kw["chat_template"] = cfg["chat_template"]
    return PreTrainedTokenizerFast(tokenizer_file=str(saved / "tokenizer.json"), **kw)


def _same_tokenizer(a, b) -> bool:
    """Whether b tokenizes, detokenizes and templates as a does: the vocabulary and
    special ids, the probe text (with each special token in it) both ways, and a chat."""
    def chat(t):
        if not getattr(t, "chat_template", None):
            return None
        return t.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                     tokenize=False, add_generation_prompt=True)

    if a.get_vocab() != b.get_vocab() or sorted(a.all_special_ids) != sorted(b.all_special_ids):
        return False
    if (a.eos_token_id, a.bos_token_id, a.pad_token_id) != (b.eos_token_id, b.bos_token_id, b.pad_token_id):
        return False
    text = _PROBE + " ".join(a.all_special_tokens) + _PROBE
    for special in (True, False):
        ids = a(text, add_special_tokens=special)["input_ids"]
        if ids != b(text, add_special_tokens=special)["input_ids"]:
            return False
        if any(a.decode(ids, skip_special_tokens=s) != b.decode(ids, skip_special_tokens=s) for s in (True, False)):
            return False
    return chat(a) == chat(b)
