"""Parity with HF transformers (reference only) on tiny random models of each architecture."""
import pytest
import torch

from headwise import LLM, SamplingParams
from tests.conftest import ARCHS

PROMPT = "The history of the city begins with a small settlement on the river, where"


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_hf(arch, tiny_models):
    llm = LLM(str(tiny_models[arch]), head_layout="full", kv_cache_memory=1 << 24)
    ids = llm.tokenizer.encode(PROMPT * 3)
    with torch.no_grad():
        ref = _hf(tiny_models[arch])(torch.tensor([ids])).logits[0]
    ours = llm.engine.prompt_logits(ids)
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuation_matches_hf(arch, tiny_models):
    llm = LLM(str(tiny_models[arch]), head_layout="full", kv_cache_memory=1 << 24)
    ids = llm.tokenizer.encode(PROMPT)
    hf = _hf(tiny_models[arch])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == ref
    assert len(set(ref)) > 3  # the random model is not stuck on one token
