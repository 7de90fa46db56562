"""Decode steps captured with torch.compile, so a small step is not thousands of
separately dispatched PyTorch calls.

A step of at most CAPTURE_MAX_TOKENS tokens (decode at batch 1-8, or a tiny prefill) runs
the model body (embedding and every layer: norms, projections, rotary, residuals) as one
Inductor graph. Attention stays the layers' own code, an opaque custom op inside the graph
(headwise::attention), because its cache writes and its backend's shape-dependent Python
differ from step to step; packed oneDNN matmuls are opaque ops too (layers.linear). The
graph is C++ end to end (Inductor's cpp_wrapper), and it skips Dynamo's guards on module
attributes, which the engine never changes after loading. Dynamo keeps compiled graphs on
the code object, and with those guards skipped nothing tells one model from another of the
same input shapes: each engine therefore compiles its own copy of the function (a code
object of its own), whose graphs die with the engine.

Policy, EngineConfig.enforce_eager:
    None (default): captured where it pays: on the CPU when decode reads 4-bit weights
          (a GGUF Q4 model computing in bfloat16). Measured by
          benchmarks/bench_decode_capture.py; elsewhere it is unmeasured or did not pay.
    False: captured wherever torch.compile works (float32, other devices).
    True: never (vLLM's --enforce-eager).
On CUDA the step is also replayed from CUDA graphs (engine.cuda_graphs) unless True; with
False the graphs capture the compiled body.
Compilation happens at start (warm-up with dry steps of 1 and 2 tokens; the second compile
covers 2-8 tokens with a dynamic size; on a CPU with AMX a 4-bit model's 2-8 graph is
split at 5 tokens, a third dry step, see warmup_tokens), not in a request's latency; its seconds are logged
and kept in `compile_s`. Where it fails (no C++ compiler, an op Inductor cannot handle) the
engine runs eagerly, with one log line. With EngineConfig.compile_in_background the
engine does not wait for it: a thread compiles while steps run eagerly, and the compiled
graph takes over once every size is ready (the CPU only: CUDA graphs capture the
compiled body at start). Code that branches on being traced asks
torch.compiler.is_dynamo_compiling(), which Dynamo answers in the trace only:
is_compiling() reads a process-wide flag, so eager steps on the engine's thread would
take the traced branches while another thread compiles.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import types

import torch

from headwise.layers import opaque
from headwise.layers.attention import HeadSplitAttention
from headwise.layers.context import StepContext, step_context
from headwise.layers.int4 import INT4_MAX_ROWS, Int4Copy, torch_int4_rows
from headwise.layers.linear import Linear
from headwise.models.causal_lm import CausalLM

log = logging.getLogger("headwise.capture")

CAPTURE_MAX_TOKENS = INT4_MAX_ROWS  # steps up to this many tokens run the captured graph
WARMUP_TOKENS = (1, 2)  # compiled at start: 1, then 2-8 (dynamic size); see warmup_tokens
_COPIES = itertools.count()
OPTIONS = {"cpp_wrapper": True,
           "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


def warn_eager(logger: logging.Logger, what: str, e: Exception) -> None:
    """One warning line for a capture that failed (the error's first line); the
    traceback at debug level."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    logger.warning("%s: %s: %s", what, type(e).__name__, first)
    logger.debug("%s", what, exc_info=True)


def reads_int4(model: CausalLM) -> bool:
    """Whether decode-sized calls of `model` read 4-bit weights (see layers.linear)."""
    return any(isinstance(m, Int4Copy) and m.int4 is not None for m in model.modules())


def warmup_tokens(model: CausalLM, device: torch.device) -> tuple[int, ...]:
    """The step sizes compiled at start: WARMUP_TOKENS, and one past torch_int4_rows()
    where that is within the graphs' sizes (a CPU with AMX: 5), whose 4-bit matmuls leave
    PyTorch's int4 kernel for kernels.codes_gemm (layers.int4.Int4Copy.int4_mm): that
    graph would otherwise compile in the first such step's latency."""
    if device.type == "cpu" and reads_int4(model) and torch_int4_rows() < CAPTURE_MAX_TOKENS:
        return WARMUP_TOKENS + (torch_int4_rows() + 1,)
    return WARMUP_TOKENS


def _body(model: CausalLM, input_ids: torch.Tensor, tables: dict) -> torch.Tensor:
    return model.hidden_states(input_ids, tables)


def _own_copy(fn: types.FunctionType, name: str) -> types.FunctionType:
    """`fn` with a code object of its own (Dynamo's graphs and guards live there)."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name)


class DecodeCapture:
    """The model runner's forward: the captured graph for small steps, else eager."""

    def __init__(self, model: CausalLM, device: torch.device, enforce_eager: bool | None) -> None:
        self.model = model
        self.device = device
        self.compile_s = 0.0
        if enforce_eager is None:
            self.enabled = device.type == "cpu" and reads_int4(model)
        else:
            self.enabled = not enforce_eager
        self.graph = None
        self.ready = threading.Event()  # set once the compiled graph may run
        self.compiler: threading.Thread | None = None
        if self.enabled:
            for m in model.modules():
                if isinstance(m, (Linear, HeadSplitAttention)):
                    opaque.register(m)
            self._body = _own_copy(_body, f"captured_step_{next(_COPIES)}")

    def applies(self, num_tokens: int) -> bool:
        return self.enabled and self.ready.is_set() and num_tokens <= CAPTURE_MAX_TOKENS

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> the last layer's output [T, hidden]: the compiled
        graph for a small step, else eager (also what a CUDA graph captures)."""
        tables = self.model.rope_tables(positions)
        if self.applies(input_ids.shape[0]):
            return self.graph(self.model, input_ids, tables)
        return self.model.hidden_states(input_ids, tables)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T]; returns float32 logits [len(logits_indices), V]
        return self.model.logits(self.hidden_states(input_ids, positions), logits_indices)

    def warm_up(self, background: bool = False) -> None:
        """Compile for every size in WARMUP_TOKENS with dry steps (attention returns zeros
        and writes no cache); on failure, fall back to eager for good. background: on a
        daemon thread, steps running eagerly until it is done (wait() joins it)."""
        if not self.enabled:
            return
        log.info("compiling the decode step%s (about 10 s; up to a few minutes the first time on a "
                 "machine, then cached; enforce_eager=True / --enforce-eager skips it)",
                 " in the background" if background else "")
        if background:
            self.compiler = threading.Thread(target=self._compile, name="decode-capture", daemon=True)
            self.compiler.start()
        else:
            self._compile()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a background compile is done (or `timeout` s); whether the
        compiled graph now runs."""
        if self.compiler is not None:
            self.compiler.join(timeout)
        return self.enabled and self.ready.is_set()

    def _compile(self) -> None:
        t0 = time.perf_counter()
        # torch.compile itself imports Dynamo (1-1.5 s): here, on the compiling thread.
        options = OPTIONS if self.device.type == "cpu" else {}
        try:
            self.graph = torch.compile(self._body, dynamic=None, options=options)
        except Exception as e:  # noqa: BLE001 - any compiler failure means eager
            self.enabled = False
            warn_eager(log, "decode capture unavailable, running eagerly", e)
            return
        for n in warmup_tokens(self.model, self.device):
            # Made as the model runner makes its inputs (outside inference mode), so the
            # graph's guards accept the real steps.
            ids = torch.zeros(n, dtype=torch.int64, device=self.device)
            pos = torch.arange(n, dtype=torch.int64, device=self.device)
            try:
                with step_context(StepContext(positions=pos, full_slots=pos, dry_run=True)), torch.inference_mode():
                    self.graph(self.model, ids, self.model.rope_tables(pos))
            except Exception as e:  # noqa: BLE001 - any compiler failure means eager
                self.enabled, self.graph = False, None
                warn_eager(log, "decode capture unavailable, running eagerly", e)
                return
        self.compile_s = time.perf_counter() - t0
        self.ready.set()
        log.info("decode step captured for steps of 1-%d tokens (compiled in %.1f s)",
                 CAPTURE_MAX_TOKENS, self.compile_s)
