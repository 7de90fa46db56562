"""Shared measuring code for the benchmark scripts (no pass/fail, only figures)."""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from headwise.evaluation.passkey import FILLER


@dataclass
class Stat:
    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, xs: list[float]) -> "Stat":
        return cls(statistics.median(xs), min(xs), max(xs))

    def fmt(self, spec: str = ".2f") -> str:
        return f"{self.median:{spec}} [{self.lo:{spec}}-{self.hi:{spec}}]"


def prompt_ids(tokenizer, num_tokens: int, salt: int = 0) -> list[int]:
    """Exactly `num_tokens` token ids of filler text (varied by `salt`)."""
    text = f"Document {salt}. " + FILLER * (num_tokens // 8 + 8)
    ids = tokenizer.encode(text)
    if len(ids) < num_tokens:
        raise ValueError("filler too short")
    return ids[:num_tokens]


def headwise_single(llm, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(time to first token s, decode tokens/s) for one cold request at batch 1: nothing
    left in the prefix cache by earlier runs of the same prompt."""
    from headwise import SamplingParams

    llm.reset_prefix_cache()
    out = llm.generate([ids], SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True), use_tqdm=False)[0]
    return out.ttft_s, new_tokens / (out.latency_s - out.ttft_s)


def headwise_aggregate(llm, context: int, num_seqs: int, steps: int) -> float:
    """Aggregate decode tokens/s with `num_seqs` sequences whose cache already holds
    `context` tokens. The prefill is skipped (sequences are placed in the cache directly):
    decode cost depends on cache sizes, not on the cached values."""
    from headwise import SamplingParams
    from headwise.engine.sequence import Sequence, SeqStatus

    eng = llm.engine
    seqs = []
    for i in range(num_seqs):
        seq = Sequence([(7 * i + j) % 1000 + 100 for j in range(context)],
                       SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        eng.cache.allocate(seq.seq_id, context)
        seq.num_computed_tokens = context - 1
        seq.status = SeqStatus.RUNNING
        eng.scheduler.running.append(seq)
        seqs.append(seq)
    eng.step()  # warm-up step
    t0 = time.perf_counter()
    done = 0
    for _ in range(steps):
        done += len(eng.step())
    dt = time.perf_counter() - t0
    for s in seqs:
        if not s.is_finished:
            eng.abort(s)
    return done / dt


class TimingStreamer:
    """HF streamer recording when the prompt and each new token arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_single(model, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(time to first token s, decode tokens/s) of transformers generate at batch 1."""
    s = TimingStreamer()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(torch.tensor([ids]), max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1,
                       do_sample=False, streamer=s, pad_token_id=0)
    # times[0]: prompt handed over; times[1]: first new token; times[-1]: last one.
    return s.times[1] - t0, new_tokens / (s.times[-1] - s.times[1])


def load_hf_default(dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from headwise.weights.loader import default_model_path

    p = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype).eval()


# The x86 instruction sets behind this project's CPU speed gaps: AMX (PyTorch's bfloat16
# matmuls use it; llama.cpp is built without it on these machines, Makefile) and AVX-512
# (both use it). Results files name which of them the CPU had, as issue #32 asks.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return ""


def isa_flags(cpuinfo: str) -> list[str]:
    """The ISA_FLAGS that the first `flags` line of a /proc/cpuinfo text lists, in
    ISA_FLAGS' order ([] without such a line, e.g. on ARM, whose line is `Features`)."""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[1].split()) if ":" in line else set()
    return [f for f in ISA_FLAGS if f in have]


def cpu_model() -> str:
    """The architecture, the CPU's model name and its ISA_FLAGS (/proc/cpuinfo): this
    project's machines are Intel or AMD by draw, and bfloat16 prefill differs ~3.5x between
    them (AMX)."""
    info = _cpuinfo()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    arch = platform.processor() or platform.machine()
    flags = " ".join(isa_flags(info)) or "no AVX2/AVX-512/AMX"
    return f"{arch} ({name}; {flags})" if name else f"{arch} ({flags})"


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu_model()}, {os.cpu_count()} cores, {mem:.0f} GiB, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")


def save(path: str, payload: dict, table: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1))
    Path(path).with_suffix(".md").write_text(table + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(layout: str | None, args: list[str], log=subprocess.DEVNULL,
                 wait_s: float = 900.0) -> tuple[subprocess.Popen, str]:
    """`headwise serve` on a free loopback port with `--head-layout layout` (None: the
    model's default) and further CLI `args`; returns (process, base URL) once /health
    answers. wait_s covers a first start on a new machine: preparing the weights and
    compiling the decode step of Qwen2.5-Coder-1.5B took over 300 s there while another
    build shared the two cores; a server that exits is reported at once."""
    port = free_port()
    cmd = [sys.executable, "-m", "headwise.cli", "serve", "--port", str(port), *args]
    if layout is not None:
        cmd += ["--head-layout", layout]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)  # both to `log`
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"headwise serve did not start: {' '.join(cmd)}")
