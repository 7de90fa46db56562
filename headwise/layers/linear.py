"""Linear layer whose weight can be prepacked for oneDNN on the CPU, and whose weight,
where it is exactly 4-bit (else exactly int8 or 5-bit per group), is also kept so for decode.

Plain F.linear on the CPU reorders the weight into oneDNN's blocked layout on every call.
`pack()` does it once. The packed kernel also applies SiLU and a following elementwise
multiply inside the matmul, so the MLP makes no separate elementwise passes.

Decode at small batch reads every weight once per step, so it is bound by memory
bandwidth. A GGUF Q4_1, Q4_0 or Q4_K tensor is 4-bit codes with a scale and an offset per
group of 32 inputs; `find_int4()` takes them from the file's blocks (`quant`, set by
the GGUF loader: layers.quant), or else recovers them exactly from the float32 weight (a
search: HF checkpoints, formats the loader does not read), and calls with at most
INT4_MAX_ROWS rows then run PyTorch's int4 CPU matmul on a quarter of the bytes
(layers.int4; bfloat16 activations only: the kernel is slow with float32 ones, see
INT4_DTYPES). A weight that is exactly int8 codes times a scale per 32 inputs (GGUF Q8_0,
Q5_0) or per 16 (Q6_K, Q3_K), or 5-bit codes times a scale plus a minimum per 32 (Q5_1,
Q5_K), keeps those as int8 for calls of at most 4 rows instead (kernels.int8_matmul: about
half the bytes of bfloat16), chosen inside the packed call.
Larger calls (prefill, big batches) use the packed dense weight, except in a model
prepared without dense copies (CausalLM.prepare_weights(dense=False), the engine's default
on a bfloat16 CPU: a 4-bit weight is a third of the bytes, an int8 one about 60%), whose
larger calls read the codes too (kernels.codes_gemm, else PyTorch's int4 kernel), an
MLP's gate and up as one gated call (FusedInt4.glu, int8_glu). Under torch.compile a packed call, and
a call over int8 codes only, is an opaque custom op (headwise::packed_linear): Inductor
lowers oneDNN's packed matmul only for weights it packed itself.

Measured by benchmarks/bench_linear.py on this project's 2-core AVX512-BF16 machine
(bfloat16, SmolLM2's 210 projections): at 1 row plain 22.6 ms, packed 13.0, 4-bit 5.1;
at 4 rows 23.3 / 12.1 / 7.4; at 16 rows 29.6 / 17.8 / 22.6 (4-bit loses from here);
at 1024 rows 589 / 541 / 1324.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from headwise.kernels.codes_gemm import int4_gemm_glu, int8_gemm, int8_gemm_glu, int8_gemm_takes
from headwise.kernels.int8_matmul import MAX_ROWS as INT8_MAX_ROWS
from headwise.kernels.int8_matmul import check_int8_weight, int8_copy, int8_matmul
from headwise.layers import opaque
from headwise.layers.int4 import (INT4_DTYPES, Int4Copy, decode_sized, exact_int4, int4_any_rows, int4_cast,
                                  int4_codes, int4_pack, torch_int4_rows)
from headwise.layers.quant import QuantCodes

# Row count the packed layout is tuned for. Prefill dominates the cost of a long prompt;
# decode-sized calls still run 1.7-1.9x faster than plain F.linear with it (bench_linear).
PACK_ROWS = 1024
# Activation dtypes an int8 copy (kernels.int8_matmul) is kept for: where the dense weight
# is bfloat16, so the copy halves the bytes a decode step reads (float32 engines are the
# reference runs and keep their exact dense weights).
INT8_DTYPES = (torch.bfloat16,)
# activation -> oneDNN post-op (attribute, algorithm) fused into the packed matmul
ACTIVATIONS = {"none": ("none", ""), "silu": ("swish", ""), "gelu_tanh": ("gelu", "tanh")}


@torch.library.custom_op("headwise::packed_linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, layer: torch.Tensor, out_features: int, act: str,
                     other: torch.Tensor | None) -> torch.Tensor:
    """Linear.packed_call of the layer whose op_key is `layer` (see layers.opaque)."""
    return opaque.lookup(layer).packed_call(x, act, other)


@packed_linear_op.register_fake
def _(x, layer, out_features, act, other):
    return x.new_empty(*x.shape[:-1], out_features)


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def activate(y: torch.Tensor, act: str) -> torch.Tensor:
    """`act` (a key of ACTIVATIONS) applied to y, as its own op."""
    if act == "silu":
        return F.silu(y)
    return F.gelu(y, approximate="tanh") if act == "gelu_tanh" else y


class Linear(Int4Copy, nn.Module):
    """y = x @ weight.T + bias, with the same parameter names as nn.Linear, so checkpoints
    load as is. After pack() the plain weight is dropped (the packed copy replaces it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN-blocked weight, opaque tensor
        # 4-bit copy for small calls (see Int4Copy.int4). Found while float32; pack() casts
        # the scales to the activation dtype, and only a packed layer uses it.
        Int4Copy.init(self)
        self.fused_int4 = False  # part of a FusedInt4: needs no decode copy of its own
        # int8 copy for calls of a few rows, where the weight is exactly int8 codes times a
        # scale per 32 (or 16) inputs, or 5-bit codes times a scale plus a minimum per 32,
        # and not 4-bit: codes [out, in] int8, scales [out, in/32 or in/16], lows like
        # scales or None.
        self.register_buffer("int8_codes", None, persistent=False)
        self.register_buffer("int8_scales", None, persistent=False)
        self.register_buffer("int8_lows", None, persistent=False)
        # The weight's codes as its file stores them (layers.quant), where the loader read
        # them; whoever edits the weight moves them along or drops them. pack() drops them.
        self.quant: QuantCodes | None = None
        bound = 1 / math.sqrt(in_features)  # nn.Linear's initialisation (random-weight tests)
        if not self.weight.is_meta:  # nothing to fill on meta (a model being loaded)
            nn.init.uniform_(self.weight, -bound, bound)
            if self.bias is not None:
                nn.init.uniform_(self.bias, -bound, bound)

    def find_int4(self) -> bool:
        """Keep a 4-bit copy of the weight if it is 4-bit: its file's codes (`quant`), else
        exact_int4's search; call while the weight is still float32, before the model is
        cast."""
        if (self.weight is None and self.quant is None) or self.fused_int4:
            return False
        found = int4_codes(self.quant) if self.quant is not None else exact_int4(self.weight.detach())
        if found is None:
            return False
        self.int4 = int4_pack(*found)
        return True

    def find_int8(self) -> bool:
        """Keep an int8 copy of the weight if it has no 4-bit one and is exactly int8 codes
        times a scale per 32 or 16 inputs, or 5-bit codes times a scale plus a minimum per
        32: its file's codes (`quant`), else kernels.int8_matmul.int8_copy's search; call
        while the weight is still float32."""
        if (self.weight is None and self.quant is None) or self.int4 is not None or self.fused_int4:
            return False
        found = self.quant.int8() if self.quant is not None else int8_copy(self.weight.detach())
        if found is None:
            return False
        self.int8_codes, self.int8_scales, self.int8_lows = found
        return True

    def packable(self) -> bool:
        """Whether pack() will pack this layer: its weight, or the codes it is to be made
        from, is on the CPU in a dtype oneDNN packs (checked while float32)."""
        ref = self.weight if self.weight is not None else None if self.quant is None else self.quant.scales
        return ref is not None and can_pack(ref)

    def materialize(self, dtype: torch.dtype, scratch: torch.Tensor | None = None) -> None:
        """The dense weight in `dtype` from the file's codes where loading left it out
        (weights.loader.load_weights' lazy mode); one float32 temporary at a time.
        `scratch` (flat, `dtype`, at least the weight's size): made there, for a caller
        that packs it at once (pack() lets go of it) and reuses the memory."""
        if self.weight is None and self.quant is not None:
            N, K = self.quant.shape
            out = None if scratch is None else scratch[:N * K].view(N, K)
            self.weight = nn.Parameter(self.quant.dense(dtype, out), requires_grad=False)

    def pack(self) -> bool:
        """Prepack the weight for oneDNN; False (and nothing changes) where that is not
        supported: not on the CPU, or a dtype other than float32/bfloat16."""
        if self.packed is not None:
            return True
        self.quant = None  # the copies are taken (or not) by now
        if self.weight is None or not can_pack(self.weight):
            self.int4 = None  # only a packed layer uses them
            self.int8_codes = self.int8_scales = self.int8_lows = None
            return False
        if self.int4 is not None:
            self.int4 = int4_cast(self.int4, self.weight.dtype)
        if self.weight.dtype not in INT8_DTYPES:
            self.int8_codes = self.int8_scales = self.int8_lows = None
        elif self.int8_codes is not None:  # once here, not per call (the copy is final now)
            check_int8_weight(self.int8_codes, self.int8_scales, self.int8_lows)
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS)
            if self.bias is not None:
                self.bias.data = self.bias.data.contiguous()
        self.weight = None  # a tied weight stays with its other owner (the embedding)
        return True

    def codes_suffice(self, dtype: torch.dtype) -> bool:
        """Whether every call in activations of `dtype` can read the layer's codes alone
        (keep_codes_only): a 4-bit copy and a dtype of INT4_DTYPES, else an int8 copy that
        kernels.codes_gemm.int8_gemm reads on this machine and a dtype of INT8_DTYPES."""
        if self.int4 is not None:
            return dtype in INT4_DTYPES
        return (self.int8_codes is not None and dtype in INT8_DTYPES
                and int8_gemm_takes(self.int8_codes, self.int8_scales, self.int8_lows))

    def keep_codes_only(self, dtype: torch.dtype) -> None:
        """Run every call on the layer's codes (codes_suffice): its 4-bit copy (scales cast
        to `dtype`), else its int8 copy (scales stay float32). The dense weight is let go
        of, or never made from the file's codes (CausalLM.prepare_weights(dense=False))."""
        if not self.codes_suffice(dtype):
            raise ValueError(f"keep_codes_only: needs a 4-bit copy and {INT4_DTYPES} activations, or an int8 "
                             f"copy the int8 matmul reads and {INT8_DTYPES} activations")
        if self.int4 is not None:
            self.int4 = int4_cast(self.int4, dtype)
            self.drop_dense()
        else:
            check_int8_weight(self.int8_codes, self.int8_scales, self.int8_lows)
            self.quant = self.weight = None  # a tied weight stays with its other owner
        if self.bias is not None:
            self.bias.data = self.bias.data.to(dtype).contiguous()

    def drop_dense(self) -> None:
        """Let go of the dense weight, the file's codes and the int8 copy (a weight kept as
        4-bit codes only, its own or its fusion's); a tied weight stays with its other owner."""
        self.quant = self.weight = None
        self.int8_codes = self.int8_scales = self.int8_lows = None

    @property
    def codes_only(self) -> bool:
        """Kept as its 4-bit or int8 copy alone (keep_codes_only): every call reads the codes."""
        return self.packed is None and self.weight is None and (self.int4 is not None or self.int8_codes is not None)

    def dense_weight(self) -> torch.Tensor:
        """The weight [out, in] in plain layout, packed or not; as the 4-bit kernel computes
        it for a layer kept as codes only."""
        if self.codes_only and self.int4 is None:  # bfloat16: the one dtype kept so (INT8_DTYPES)
            return self._int8_quant().dense(torch.bfloat16)
        if self.codes_only:  # x = I gives the weight's columns; rows of I in runs of 1024
            eye = torch.eye(self.in_features, dtype=self.int4_scales.dtype)
            return torch.cat([int4_any_rows(eye[r:r + 1024], self.int4)
                              for r in range(0, self.in_features, 1024)]).t().contiguous()
        return self.weight.detach() if self.packed is None else self.packed.to_dense()

    def forward(self, x: torch.Tensor, act: str = "none") -> torch.Tensor:
        # x: [..., in] -> [..., out]; act (ACTIVATIONS) applied to the result.
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; expected one of {tuple(ACTIVATIONS)}")
        if self.codes_only:
            return activate(self.int4_mm(x), act) if self.int4 is not None else self._packed(x, act, None)
        small = self._small(x)
        if self.packed is not None and not small:
            return self._packed(x, act, None)
        return activate(self.int4_mm(x) if small else F.linear(x, self.weight, self.bias), act)

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """self(x) * other, the product taken inside the matmul when packed."""
        if (self.codes_only and self.int4 is not None) or self._small(x):
            return self.int4_mm(x) * other
        if self.packed is not None or self.codes_only:
            return self._packed(x, "none", other)
        return F.linear(x, self.weight, self.bias) * other

    def _packed(self, x: torch.Tensor, act: str, other: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_dynamo_compiling():
            return packed_linear_op(x, self.op_key, self.out_features, act, other)
        return self.packed_call(x, act, other)

    def packed_call(self, x: torch.Tensor, act: str, other: torch.Tensor | None) -> torch.Tensor:
        """The packed weight's matmul with `act` fused, or (other given) times `other`; a
        call of a few rows goes through the int8 copy where there is one (decided here, at
        run time, so a compiled graph holds one op for every row count), and every call
        does where that copy is all there is of the weight."""
        y = self._int8(x) if self.packed is not None else self._int8_any_rows(x)
        if y is not None:
            return activate(y, act) if other is None else y * other
        if other is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other.contiguous(), self.packed, self.bias, "mul")
        attr, algorithm = ACTIVATIONS[act]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, attr, [], algorithm)

    def _int8(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, in] through the int8 copy (plus bias) -> [M, out], or None where it does
        not apply (no copy, more rows than kernels.int8_matmul.MAX_ROWS, no kernel)."""
        if self.int8_codes is None:
            return None
        y = int8_matmul(x, self.int8_codes, self.int8_scales, self.int8_lows, checked=True)
        return y if y is None or self.bias is None else y + self.bias

    def _int8_any_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] through an int8 copy kept as the only weight (plus bias) -> [..., out]:
        kernels.int8_matmul up to its row count, kernels.codes_gemm above; activations
        neither takes (float32, a strided view) multiply the weight made dense for the call."""
        x2 = x.reshape(-1, x.shape[-1])
        y = self._int8(x2)
        if y is None:
            y = int8_gemm(x2, self.int8_codes, self.int8_scales, self.int8_lows)
            if y is None:
                y = F.linear(x2, self._int8_quant().dense(x.dtype))
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _int8_quant(self) -> QuantCodes:
        """The int8 copy as layers.quant's form (its dense() is the weight it stands for)."""
        group = self.in_features // self.int8_scales.shape[1]
        return QuantCodes(self.int8_codes, self.int8_scales, self.int8_lows, group, 256)

    def _small(self, x: torch.Tensor) -> bool:
        return self.packed is not None and self.int4 is not None and decode_sized(x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed={self.packed is not None}, "
                f"int4={self.int4 is not None}, int8={self.int8_codes is not None}")


def int8_glu(gate: Linear, up: Linear, x: torch.Tensor, act: str) -> torch.Tensor | None:
    """act(gate(x)) * up(x) in one pass over two weights kept as int8 codes only
    (kernels.codes_gemm.int8_gemm_glu), for calls above kernels.int8_matmul's row count;
    None elsewhere (the caller runs the two matmuls)."""
    if not (gate.codes_only and up.codes_only and gate.int4 is None and up.int4 is None
            and gate.bias is None and up.bias is None and x.dim() >= 2):
        return None
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= INT8_MAX_ROWS:
        return None
    y = int8_gemm_glu(x2, (gate.int8_codes, gate.int8_scales, gate.int8_lows),
                      (up.int8_codes, up.int8_scales, up.int8_lows), act)
    return None if y is None else y.view(*x.shape[:-1], gate.out_features)


class FusedInt4(Int4Copy, nn.Module):
    """Several Linear layers reading the same input (q/k/v, gate/up) as one 4-bit matmul
    for decode-sized calls: one kernel call and one pass over the input instead of several.
    Built while the weights are float32 and exactly 4-bit (else `int4` stays None and the
    layers run on their own); the layers then keep no decode copies of their own
    (`fused_int4`: built before they look for them, or they drop theirs). Prefill keeps
    the layers' packed dense weights (their fused activation post-ops pay there), unless
    the parts are kept as codes only (CausalLM.prepare_weights(dense=False)): then this
    copy serves every call."""

    def __init__(self, parts: list[Linear]) -> None:
        super().__init__()
        self.in_features = parts[0].in_features
        self.sizes = [p.out_features for p in parts]
        self.parts = tuple(parts)  # a tuple: not registered again as submodules
        Int4Copy.init(self)
        self.register_buffer("bias", None, persistent=False)
        if all(p.quant is not None for p in parts):
            quant = QuantCodes.cat_rows([p.quant for p in parts])
            found = None if quant is None else int4_codes(quant)
        elif all(p.weight is not None for p in parts):
            found = exact_int4(torch.cat([p.weight.detach() for p in parts]))
        else:
            return
        if found is None or not all(p.packable() for p in parts):
            return
        self.int4 = int4_pack(*found)
        if any(p.bias is not None for p in parts):
            self.bias = torch.cat([p.bias.detach() if p.bias is not None else torch.zeros(p.out_features)
                                   for p in parts])
        for p in parts:  # decode reads this copy, prefill their packed weights
            p.int4, p.fused_int4 = None, True

    def cast(self, dtype: torch.dtype) -> None:
        """To the activation dtype (after the model is cast); dropped for a dtype the 4-bit
        kernel is slow in (INT4_DTYPES), the parts then running packed."""
        if self.int4 is not None:
            self.int4 = int4_cast(self.int4, dtype)
        if self.bias is not None:
            self.bias = self.bias.to(dtype) if self.int4 is not None else None

    def keep_codes_only(self) -> None:
        """The parts let go of their dense weights (or never make them): this copy, already
        cast, serves every call."""
        for p in self.parts:
            p.drop_dense()

    @property
    def codes_only(self) -> bool:
        """Whether this copy is all there is of the parts' weights (keep_codes_only)."""
        return self.int4 is not None and all(p.packed is None and p.weight is None for p in self.parts)

    def applies(self, x: torch.Tensor) -> bool:
        return self.int4 is not None and (decode_sized(x) or self.codes_only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [M, K] -> [M, sum(sizes)], the parts' outputs side by side
        return self.int4_mm(x)

    def glu(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """act(gate(x)) * up(x) -> [M, I] for a gate/up fusion (two parts of I outputs)
        kept as codes only, in one pass over the codes (kernels.codes_gemm.int4_gemm_glu),
        for the calls int4_any_rows gives to codes_gemm (above torch_int4_rows()); None
        elsewhere (the caller splits forward's output)."""
        if (not self.codes_only or x.dim() != 2 or x.shape[0] <= torch_int4_rows() or self.bias is not None
                or len(self.sizes) != 2 or self.sizes[0] != self.sizes[1]):
            return None
        return int4_gemm_glu(x, *self.int4, act)
