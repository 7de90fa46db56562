"""HF transformers on the same weights, as a reference row in `headwise eval --transformers`:
the same prompts (headwise's tokenizer of the model), greedy, for the retrieval tasks. It
answers to what evaluate_layout asks of an LLM: `tokenizer` and `generate`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from headwise.sampling import SamplingParams
from headwise.weights.loader import load_tokenizer, resolve_model_path

# Tasks the reference runs: generation only (no engine to score prompts with).
REFERENCE_TASKS = ("passkey", "niah", "ruler")


@dataclass
class _Output:
    text: str
    token_ids: list[int]


class TransformersReference:
    def __init__(self, model: str | None, dtype: torch.dtype = torch.bfloat16) -> None:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(model)
        if path.is_file():
            self.hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        else:
            self.hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        self.tokenizer = load_tokenizer(model)
        self.hf.eval()

    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams, use_tqdm: bool = False) -> list[_Output]:
        if params.temperature != 0:
            raise ValueError("the transformers reference decodes greedily only")
        outs = []
        for prompt in [prompts] if isinstance(prompts, str) else prompts:
            ids = self.tokenizer.encode(prompt)
            gen = self.hf.generate(torch.tensor([ids]), max_new_tokens=params.max_tokens, do_sample=False,
                                   pad_token_id=self.tokenizer.eos_token_id)[0, len(ids):].tolist()
            text = self.tokenizer.decode(gen)
            for stop in params.stop:
                text = text.split(stop)[0]
            outs.append(_Output(text, gen))
        return outs
