"""Command line: headwise generate | demo | calibrate | eval | serve | bench."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from headwise.bench_serve import add_bench
from headwise.heads.layout import LayoutError
from headwise.calibration.cli import add_calibrate
from headwise.config import EngineConfig, add_engine_args, engine_options, parse_size
from headwise.demo import NEW_TOKENS, run_demo
from headwise.engine.llm_engine import LLMEngine
from headwise.evaluation.cli import add_eval
from headwise.llm import LLM
from headwise.sampling import SamplingParams
from headwise.server.app import DEFAULT_MAX_REQUEST_BYTES, serve
from headwise.server.guards import API_KEY_ENV


# A one-shot `generate` of fewer tokens than this decodes eagerly unless --enforce-eager or
# --no-enforce-eager says otherwise: compiling the decode step costs 8-10 s at start with
# Inductor's cache warm (about 2 min cold) and saves 3-5 ms a token (SmolLM2 60.6 -> 84.7,
# Gemma 3 39.5 -> 44.5 tok/s at 1K), so it pays only after a few thousand tokens.
ONE_SHOT_EAGER_TOKENS = 2048


def one_shot_options(options: dict, max_tokens: int) -> dict:
    """Engine options for one generation of up to max_tokens tokens (see
    ONE_SHOT_EAGER_TOKENS); an explicit enforce_eager is kept."""
    if options.get("enforce_eager") is None and max_tokens < ONE_SHOT_EAGER_TOKENS:
        return dict(options, enforce_eager=True)
    return options


def cmd_generate(args: argparse.Namespace) -> int:
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
    llm = LLM(args.model, **one_shot_options(engine_options(args), args.max_tokens))
    if args.chat:
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
    print(out.text)
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, "
          f"finish_reason={out.finish_reason}, ttft={out.ttft_s:.3f}s]", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    # two one-shot generations: a compiled decode step would not pay for its compile
    return run_demo(args.model, args.tokens, one_shot_options(engine_options(args), NEW_TOKENS))


def cmd_serve(args: argparse.Namespace) -> int:
    if args.shutdown_timeout < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.replicas is not None or args.ray_address is not None:
        return _serve_on_ray(args, api_key)
    engine = LLMEngine(EngineConfig.from_options(args.model, engine_options(args)))
    serve(engine, args.host, args.port, engine.config.max_queue, args.served_model_name,
          api_key=api_key, max_request_bytes=args.max_request_bytes, shutdown_timeout=args.shutdown_timeout)
    return 0


def _serve_on_ray(args: argparse.Namespace, api_key: str | None) -> int:
    try:
        from headwise.server import ray_serve  # optional: pip install 'headwise[ray]'
    except ImportError as e:
        raise UsageError(f"--replicas needs Ray Serve: pip install 'headwise[ray]' ({e})") from None
    options = engine_options(args)
    app = ray_serve.build_app(args.model, options, replicas=args.replicas or 1,
                              cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
                              max_queue=options["max_queue"], routing=args.routing,
                              served_model_name=args.served_model_name, api_key=api_key,
                              max_request_bytes=args.max_request_bytes, shutdown_timeout=args.shutdown_timeout)
    ray_serve.run(app, args.host, args.port, args.ray_address)
    return 0


class UsageError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(g)
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
    add_engine_args(d)
    d.add_argument("--tokens", type=int, default=6000, help="document length in tokens")
    d.set_defaults(func=cmd_demo)

    add_calibrate(sub)
    add_eval(sub)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", default=None)
    sv.add_argument("--api-key", default=None,
                    help=f"require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and admin routes "
                         f"(default: ${API_KEY_ENV} if set; /health and /metrics stay open)")
    sv.add_argument("--max-request-bytes", type=parse_size, default=DEFAULT_MAX_REQUEST_BYTES,
                    help="larger request bodies get 413 (default: %(default)s; units allowed)")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="on SIGTERM/SIGINT, seconds running requests get to finish before they are aborted")
    ray = sv.add_argument_group("scale-out on Ray Serve (pip install 'headwise[ray]')")
    ray.add_argument("--replicas", type=int, default=None,
                     help="serve N engine replicas behind one endpoint on Ray Serve, each request routed "
                          "to the replica holding its prefix")
    ray.add_argument("--ray-address", default=None,
                     help="join this Ray cluster (e.g. 10.0.0.1:6379 after `ray start --head`); "
                          "default: start one on this machine")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0)
    ray.add_argument("--gpus-per-replica", type=float, default=0.0)
    ray.add_argument("--routing", choices=["prefix", "round-robin"], default="prefix",
                     help="prefix: the replica holding the prompt's prefix unless it is much busier (default)")
    sv.set_defaults(func=cmd_serve, max_queue=256)

    add_bench(sub)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record (a test harness swaps it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def show_engine_logs() -> None:
    """The CLI prints headwise's INFO lines (e.g. that the decode step is being compiled,
    which takes minutes the first time on a machine) and its warnings, as plain lines on
    stderr. Once per process; a program using `LLM` configures logging itself."""
    logger = logging.getLogger("headwise")
    if any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    show_engine_logs()
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
