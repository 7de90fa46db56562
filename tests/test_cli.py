"""CLI: output on success; one clear line and a non-zero exit, no traceback, on bad input."""
import subprocess
import sys

import pytest
import torch


def run(*args):
    return subprocess.run([sys.executable, "-m", "headwise.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_prints_text(tiny_models):
    r = run("generate", "--model", str(tiny_models["llama"]), "--prompt", "Hello there", "--max-tokens", "5",
            "--head-layout", "full")
    assert r.returncode == 0, r.stderr
    assert "5 generated" in r.stderr and "finish_reason=length" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model.gguf", "--prompt", "x"], "does not exist"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt", "x", "--top-p", "2"], "top_p must be in (0, 1]"),
    (["--prompt", "x", "--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    ([], "exactly one of --prompt"),
    (["--prompt", "x", "--device", "tpu"], "device must be 'cpu' or 'cuda[:N]'"),
    pytest.param(["--prompt", "x", "--device", "cuda"], "PyTorch sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_generate_bad_input(args, message, tiny_models):
    if "--model" not in args:
        args = ["--model", str(tiny_models["llama"]), *args]
    r = run("generate", *args)
    assert r.returncode != 0
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_prompt_too_long_and_bad_layout(tiny_models, tmp_path):
    bad = tmp_path / "layout.json"
    bad.write_text("[1, 2")
    r = run("generate", "--model", str(tiny_models["llama"]), "--prompt", "x", "--head-layout", str(bad))
    assert r.returncode != 0 and "not valid JSON" in r.stderr and "Traceback" not in r.stderr
    r = run("generate", "--model", str(tiny_models["llama"]), "--prompt", "word " * 200,
            "--max-model-len", "64")
    assert r.returncode != 0 and "maximum context length is 64" in r.stderr and "Traceback" not in r.stderr
