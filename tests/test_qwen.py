"""Qwen2.5-Coder-0.5B-Instruct (GQA, 14 query / 2 KV heads, 24 blocks) by its known name,
assembled from its chunk packages: its chat template and stop token come from the GGUF as
transformers reads them, greedy output equals transformers' on the same file, and a
prefix-cache hit computes the same tokens as a cold run. Short prompts only (load time)."""
import pytest
import torch

from headwise import LLM, SamplingParams

NAME = "qwen2.5-coder-0.5b"
CHAT = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]


@pytest.fixture(scope="module")
def qwen():
    from headwise.weights.registry import parted_model_path

    try:
        path = parted_model_path(NAME)
    except FileNotFoundError as e:  # `make install` installs its packages
        pytest.fail(f"{NAME} is not installed: {e}")
    return path, LLM(NAME, head_layout="full", dtype="float32", enforce_eager=True, max_model_len=2048,
                     kv_cache_memory=1 << 28)


def test_known_name_chat_template_and_stop_token(qwen):
    _, llm = qwen
    assert llm.engine.model_name == "Qwen2.5-Coder-0.5B-Instruct"
    cfg = llm.engine.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (24, 14, 2)
    text = llm.tokenizer.apply_chat_template(CHAT)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert llm.tokenizer.decode([min(llm.engine.eos_ids)], skip_special_tokens=False) == "<|im_end|>"
    out = llm.chat([{"role": "user", "content": "What is 2 + 3? Reply with the number only."}],
                   SamplingParams(max_tokens=16))[0]
    assert out.finish_reason == "stop" and out.text.strip() == "5", out.text


def test_greedy_matches_transformers_and_prefix_hits_change_nothing(qwen):
    from transformers import AutoModelForCausalLM

    path, llm = qwen
    ids = llm.tokenizer.encode_chat(CHAT)
    cold = llm.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    warm = llm.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert warm.num_cached_tokens > 0 and warm.token_ids == cold.token_ids
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    assert cold.token_ids == ref
