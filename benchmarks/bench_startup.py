"""Start-up of each known model, each start in a fresh process:

- cold: a headwise cache directory with no prepared weights and no tokenizer cache: the
  GGUF's codes are read, the weights prepared, then written to the prepared-weights cache
  in the background (the child waits for that after measuring). Its C kernels are the
  machine's, copied from the real cache directory (they are built once per machine, by
  whichever model starts first; a first build is timed on its own, "C kernels built");
- warm: the same directory again, the prepared weights read from it;
- llama.cpp: llama-cpp-python's Llama() on the same file, flash attention on;
- with --dense-too, cold and warm again with dense_weights=True (prepacked bfloat16 copies
  of the quantized weights beside their codes, the engine's default until 2026-12-05; by
  default a CPU engine in bfloat16 keeps the codes alone: config.keeps_dense_weights), in
  a cache of their own.

Figures: seconds to an engine ready for requests, with the decode step compiling in the
background (compile_in_background=True; a plain LLM() waits for it); the compile's own
seconds (Inductor's on-disk cache as this machine has it: warm after any earlier run);
seconds from start to the first 8 tokens of a short prompt; peak RSS when ready (VmHWM)
and over the whole run. Import time is reported apart ("import headwise": torch and the
package).

    python benchmarks/bench_startup.py [--models smollm2-135m-instruct,gemma-3-270m,...]
        [--dense-too] [--out bench/startup.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, save  # noqa: E402

MODELS = ["smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
PROMPT = "def fibonacci(n):"

# Both children: the peak-RSS reader, then the import timed (IMPORT is the library).
PRELUDE = r"""
import json, sys, time

def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024

t0 = time.perf_counter()
IMPORT
t_import = time.perf_counter() - t0
t1 = time.perf_counter()
"""

HEADWISE_CHILD = PRELUDE.replace("IMPORT", "from headwise import LLM, SamplingParams") + r"""
llm = LLM(sys.argv[1], kv_cache_memory=1 << 27, max_num_seqs=1, compile_in_background=True,
          dense_weights={"default": None, "dense": True}[sys.argv[3]])
ready = time.perf_counter() - t1
rss_ready = hwm()
out = llm.generate([sys.argv[2]], SamplingParams(max_tokens=8, temperature=0))[0]
first = time.perf_counter() - t1
cap = llm.engine.runner.forward
compiled = cap.wait()
compiled_at = time.perf_counter() - t1
prep = llm.engine.prepared
if prep is not None and prep.writer is not None:
    prep.writer.join()  # the next start reads what this one wrote
print(json.dumps({"import_s": t_import, "ready_s": ready, "first_tokens_s": first, "compile_s": cap.compile_s,
                  "compiled": compiled, "compiled_at_s": compiled_at, "rss_ready_mib": rss_ready,
                  "rss_peak_mib": hwm(), "tokens": len(out.token_ids)}))
"""

LLAMA_CHILD = PRELUDE.replace("IMPORT", "from llama_cpp import Llama") + r"""
llm = Llama(sys.argv[1], n_ctx=2048, flash_attn=True, verbose=False)
ready = time.perf_counter() - t1
rss_ready = hwm()
llm(sys.argv[2], max_tokens=8, temperature=0)
first = time.perf_counter() - t1
print(json.dumps({"import_s": t_import, "ready_s": ready, "first_tokens_s": first, "rss_ready_mib": rss_ready,
                  "rss_peak_mib": hwm()}))
"""


KERNELS_CHILD = r"""
import json, time
from headwise.kernels import cpu_kernels
from headwise.paths import cache_dir
t0 = time.perf_counter()
cpu_kernels.build_for_engine(pages_chosen=True)
print(json.dumps({"build_s": time.perf_counter() - t0, "dir": str(cache_dir() / "kernels")}))
"""


def child(code: str, args: list[str], env: dict) -> dict | None:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode:
        print(r.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dense-too", action="store_true",
                    help="also cold and warm starts with dense_weights=True")
    ap.add_argument("--out", default="bench/startup.json")
    args = ap.parse_args()

    from headwise.weights.loader import resolve_model_path

    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # The machine's C kernels, built first where they are not (timed), then copied into
    # each cold start's cache directory.
    with tempfile.TemporaryDirectory(prefix="headwise-kernels-") as fresh:
        built = child(KERNELS_CHILD, [], dict(env, HEADWISE_CACHE_DIR=fresh))
    kernels = child(KERNELS_CHILD, [], env)
    first_build = built["build_s"] if built else None
    rows, results = [], {}
    for name in args.models.split(","):
        path = str(resolve_model_path(name).resolve())
        size_mib = Path(path).stat().st_size / 2**20
        runs = {}
        for weights in ["default", "dense"] if args.dense_too else ["default"]:
            with tempfile.TemporaryDirectory(prefix="headwise-startup-") as cache:
                if kernels is not None:
                    shutil.copytree(kernels["dir"], Path(cache) / "kernels")
                cenv = dict(env, HEADWISE_CACHE_DIR=cache)
                tag = "" if weights == "default" else ", dense copies"
                for start in ("cold", "warm"):
                    runs[start + tag] = child(HEADWISE_CHILD, [path, PROMPT, weights], cenv)
        runs["llama.cpp"] = child(LLAMA_CHILD, [path, PROMPT], env)
        results[name] = {"file_mib": size_mib, **runs}
        for mode, r in runs.items():
            if r is None:
                rows.append(f"| {name} | {mode} | failed | | | | |")
                continue
            compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
            rows.append(f"| {name} | {mode} | {r['ready_s']:.2f} | {r['first_tokens_s']:.2f} | {compile_s} | "
                        f"{r['rss_ready_mib']:.0f} | {r['rss_peak_mib']:.0f} |")
            print(rows[-1], flush=True)
    imports = ", ".join(f"{n}: {r['cold']['import_s']:.1f} s" for n, r in results.items() if r.get("cold"))
    table = "\n".join([
        f"Start-up ({machine()}); `import headwise` not counted ({imports}); C kernels built "
        f"once per machine beforehand ({first_build or 0:.1f} s the first time).",
        "",
        "| model | start | ready s | first 8 tokens s | decode compile s (background) | RSS at ready MiB | peak RSS MiB |",
        "|---|---|---|---|---|---|---|", *rows])
    print(table)
    save(args.out, {"machine": machine(), "c_kernels_first_build_s": first_build, "results": results}, table)


if __name__ == "__main__":
    main()
