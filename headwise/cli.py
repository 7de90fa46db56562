"""Command line: headwise demo | generate | (more subcommands register themselves here)."""
from __future__ import annotations

import argparse
import sys

from headwise.cache.layout import LayoutError
from headwise.config import DTYPE_CHOICES


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head-layout", default=None,
                   help="full | window | PATH to a layout JSON (default: the model's shipped layout, else full)")
    p.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                   help="auto: bfloat16 where the device computes it natively, else float32")
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes for the KV cache (both pools)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: Triton kernels on CUDA, PyTorch on CPU")


def engine_options(args: argparse.Namespace) -> dict:
    return dict(head_layout=args.head_layout, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                attention_backend=args.attention_backend)


def cmd_generate(args: argparse.Namespace) -> int:
    from headwise import LLM, SamplingParams

    if (args.prompt is None) == (args.prompt_file is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        except OSError as e:
            raise UsageError(f"cannot read prompt file {args.prompt_file!r}: {e.strerror}") from None
    else:
        prompt = args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop or None)
    llm = LLM(args.model, **engine_options(args))
    if args.chat:
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
    print(out.text)
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, "
          f"finish_reason={out.finish_reason}, ttft={out.ttft_s:.3f}s]", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from headwise.demo import run_demo

    return run_demo(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from headwise.config import EngineConfig
    from headwise.engine.llm_engine import LLMEngine
    from headwise.server.app import serve

    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be >= 1, got {args.max_queue}")
    engine = LLMEngine(EngineConfig.from_options(args.model, engine_options(args)))
    serve(engine, args.host, args.port, args.max_queue, args.served_model_name)
    return 0


class UsageError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    _engine_args(g)
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="answer a question about a ~6,000-token document, full vs head-split")
    _engine_args(d)
    d.add_argument("--tokens", type=int, default=6000, help="document length in tokens")
    d.set_defaults(func=cmd_demo)

    from headwise.evaluation.cli import add_calibrate, add_eval

    add_calibrate(sub)
    add_eval(sub)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond this get 503")
    sv.add_argument("--served-model-name", default=None)
    sv.set_defaults(func=cmd_serve)

    from headwise.bench_serve import add_bench

    add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, LayoutError) as e:
        # Bad input: one clear line, no traceback.
        print(f"headwise: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
