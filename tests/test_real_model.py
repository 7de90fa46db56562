"""The default model (SmolLM2-135M-Instruct, from its GGUF) against transformers loading
the very same file, and a long passkey prompt answered correctly."""
import pytest
import torch

from headwise import SamplingParams
from headwise.evaluation.passkey import passkey_prompt

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In 1969, the first humans",
    "Here is a short poem about the sea:\n",
]


@pytest.fixture(scope="module")
def hf_gguf_model():
    from transformers import AutoModelForCausalLM

    from headwise.weights.loader import default_model_path

    p = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


def test_greedy_outputs_match_transformers_on_same_gguf(default_llm, hf_gguf_model):
    outs = default_llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf_gguf_model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref, prompt


def test_prompt_logits_match_transformers(default_llm, hf_gguf_model):
    ids = default_llm.tokenizer.encode(" ".join(PROMPTS) * 4)
    with torch.no_grad():
        ref = hf_gguf_model(torch.tensor([ids])).logits[0]
    # float32 both; 30 layers of matmuls whose kernels sum in different orders (on AMX
    # CPUs oneDNN picks other ones than MKL) leave ~1e-4 on logits of size ~20.
    assert (default_llm.engine.prompt_logits(ids) - ref).abs().max().item() < 3e-4


def test_passkey_at_4000_tokens(default_llm):
    p = passkey_prompt(default_llm.tokenizer, 4000, depth=0.5, seed=1)
    out = default_llm.generate(p.text, SamplingParams(max_tokens=8), use_tqdm=False)[0]
    assert 3900 <= len(out.prompt_token_ids) <= 4100
    assert p.answer in out.text, out.text
