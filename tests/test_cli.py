"""CLI: output on success; one clear line and a non-zero exit, no traceback, on bad input."""
import subprocess
import sys

import pytest
import torch

from headwise import cli


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
    (["--prompt", "x", "--kv-cache-dtype", "int3"], "invalid choice: 'int3'"),
    pytest.param(["--prompt", "x", "--kv-cache-dtype", "fp8_e4m3"], "needs a CUDA device; on the CPU use int8",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    pytest.param(["--prompt", "x", "--device", "cuda"], "PyTorch sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_generate_bad_input(args, message, tiny_models, capsys, monkeypatch):
    # In this process (a subprocess each costs ~4 s of imports); an exception escaping
    # main() fails the test as a traceback would. The subprocess tests around this one
    # check the same exit path end to end.
    if "--model" not in args:
        args = ["--model", str(tiny_models["llama"]), *args]
    monkeypatch.setattr(cli, "show_engine_logs", lambda: None)  # keep pytest's logging as it is
    try:
        code = cli.main(["generate", *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code != 0
    assert message in capsys.readouterr().err


def test_prompt_too_long_and_bad_layout(tiny_models, tmp_path):
    bad = tmp_path / "layout.json"
    bad.write_text("[1, 2")
    r = run("generate", "--model", str(tiny_models["llama"]), "--prompt", "x", "--head-layout", str(bad))
    assert r.returncode != 0 and "not valid JSON" in r.stderr and "Traceback" not in r.stderr
    r = run("generate", "--model", str(tiny_models["llama"]), "--prompt", "word " * 200,
            "--max-model-len", "64")
    assert r.returncode != 0 and "maximum context length is 64" in r.stderr and "Traceback" not in r.stderr


def test_engine_flags_come_from_engine_config():
    """Every EngineConfig field is a flag of every engine-building command, with the
    config's default, and parses back into LLM keyword arguments."""
    from dataclasses import fields

    from headwise.cli import build_parser
    from headwise.config import EngineConfig, engine_options

    parser = build_parser()
    names = [f.name for f in fields(EngineConfig)]
    for cmd in ("generate", "demo", "serve", "eval", "calibrate"):
        extra = {"generate": ["--prompt", "x"], "calibrate": ["--out", "l.json"]}.get(cmd, [])
        args = parser.parse_args([cmd, *extra])
        skip = ("head_layout",) if cmd in ("eval", "calibrate") else ()
        for n in names:
            if n in skip:
                continue
            want = 256 if (cmd, n) == ("serve", "max_queue") else None
            if cmd == "eval" and n in ("kv_cache_memory", "max_num_batched_tokens", "max_num_seqs"):
                continue  # eval's own defaults (EVAL_ENGINE_OPTIONS)
            default = next(f.default for f in fields(EngineConfig) if f.name == n)
            assert getattr(args, n) == (want if want is not None else default), (cmd, n)
    args = parser.parse_args(["generate", "--prompt", "x", "--block-size", "8", "--window-positions",
                              "rebased", "--num-threads", "1", "--kv-cache-memory", "4096"])
    opts = engine_options(args)
    assert opts["block_size"] == 8 and opts["window_positions"] == "rebased"
    assert opts["num_threads"] == 1 and opts["kv_cache_memory"] == 4096 and "model" not in opts
    EngineConfig.from_options(None, opts)  # every parsed option is a valid config field
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--dtype", "float64"])


def test_a_short_one_shot_generate_decodes_eagerly():
    from headwise.cli import ONE_SHOT_EAGER_TOKENS, build_parser, one_shot_options
    from headwise.config import engine_options

    parser = build_parser()
    opts = engine_options(parser.parse_args(["generate", "--prompt", "x"]))
    assert opts["enforce_eager"] is None  # the engine's own policy, unless generate overrides it
    assert one_shot_options(opts, 64)["enforce_eager"] is True
    assert one_shot_options(opts, ONE_SHOT_EAGER_TOKENS)["enforce_eager"] is None
    for flag, want in (("--enforce-eager", True), ("--no-enforce-eager", False)):
        explicit = engine_options(parser.parse_args(["generate", "--prompt", "x", flag]))
        assert one_shot_options(explicit, 64)["enforce_eager"] is want


def test_the_demo_decodes_eagerly_unless_told(monkeypatch):
    # two generations of a few tokens: the demo must not wait for a decode step to compile
    from headwise import cli

    seen = []
    monkeypatch.setattr(cli, "run_demo", lambda model, tokens, options: seen.append(options) or 0)
    parser = cli.build_parser()
    for argv, want in ((["demo"], True), (["demo", "--no-enforce-eager"], False)):
        args = parser.parse_args(argv)
        assert args.func(args) == 0
        assert seen[-1]["enforce_eager"] is want


def test_the_cli_shows_engine_log_lines_once(capsys):
    import logging

    from headwise.cli import show_engine_logs

    logger = logging.getLogger("headwise")
    before, level = list(logger.handlers), logger.level
    try:
        show_engine_logs()
        show_engine_logs()
        logging.getLogger("headwise.capture").info("compiling the decode step")
        assert capsys.readouterr().err == "compiling the decode step\n"
    finally:
        logger.handlers[:], logger.level = before, level


def test_attention_backends_share_signatures():
    """Both backends offer the same hooks, and every head class one decode and one prefill
    per backend, with the same signature in both."""
    import inspect

    from headwise.heads import full, window
    from headwise.layers.backend import attention_backend

    pytest.importorskip("triton")
    t, k = attention_backend("torch"), attention_backend("triton")

    def params(f):
        return list(inspect.signature(f).parameters)

    for name in ("decode_kernel", "fused_decode"):
        assert params(getattr(t, name)) == params(getattr(k, name)), name
    for name in ("__init__", "decode", "chunk_pages"):
        assert params(getattr(t.StepMetadata, name)) == params(getattr(k.StepMetadata, name)), name
    for module in (full, window):
        assert set(module._IMPLS) == {t.NAME, k.NAME}
        (td, tp), (kd, kp) = module._IMPLS[t.NAME], module._IMPLS[k.NAME]
        assert params(td) == params(kd) and params(tp) == params(kp), module.__name__
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_backend("cuda")
