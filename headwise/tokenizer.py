"""Thin wrapper over the HF tokenizer: encoding, incremental decoding, chat template."""
from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer

    @classmethod
    def from_path(cls, directory: Path, gguf_file: str | None = None) -> "Tokenizer":
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        return cls(AutoTokenizer.from_pretrained(str(directory), **kwargs))

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The template already holds the special tokens it needs.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)
