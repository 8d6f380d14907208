"""SiLU(gate) * up in one Triton kernel, and its wrapper. Reference: kernels.layer_ref.silu_mul_ref.
With FP8 (slm_core.fp8), silu_mul_quant also quantises each row to E4M3 in the same kernel, so the
[T, I] product is never written in the model dtype (reference: kernels.layer_ref.silu_mul_quant_ref),
and silu_mul_static quantises it with one scale fixed at build (kernels.layer_ref.silu_mul_static_ref).

The fused gate/up projection writes [T, 2I]; this reads each row's two halves once and writes
[T, I]. Inductor's own kernel for the same expression is autotuned at build time, and a build
beside other GPU work picked a config at half the bandwidth (25 µs instead of 13 per W1 layer,
bench/RESULTS.md); this one does not depend on that. The arithmetic follows transformers' rounding
points: silu in FP32 rounded to the model dtype, then the product rounded.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def _silu_mul(x_ptr, row, cols, ok, inner, stride_x, dtype: tl.constexpr):
    """SiLU(gate) * up of one row's columns, rounded where transformers rounds (FP32 values of dtype)."""
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype).to(tl.float32)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, scale, inner, stride_x, stride_out, BLOCK: tl.constexpr,
                     STATIC: tl.constexpr):
    """One block of a row; STATIC: divided by `scale`, saturated to E4M3's range."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inner
    y = _silu_mul(x_ptr, row, cols, ok, inner, stride_x, x_ptr.dtype.element_ty)
    if STATIC:
        y = tl.clamp((y / scale).to(tl.float32), -448.0, 448.0)  # AOTI may pass scale as fp64
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, scale_ptr, inner, stride_x, stride_q, BLOCK: tl.constexpr):
    """One row: its largest |SiLU(gate) * up| in a first pass, then the E4M3 values in a second
    (the product is recomputed, not stored: two reads of [2I] in the model dtype, one write of [I])."""
    row = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, inner, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_silu_mul(x_ptr, row, cols, cols < inner, inner, stride_x, dtype)))
    scale = tl.maximum(tl.max(amax, 0), 1e-12) / 448.0  # E4M3's largest finite value
    for start in range(0, inner, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < inner
        q = tl.clamp(_silu_mul(x_ptr, row, cols, ok, inner, stride_x, dtype) / scale, -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, scale)


def _silu_mul_into(gate_up: torch.Tensor, out_dtype: torch.dtype, scale: float, block: int):
    t, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: needs [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
    out = gate_up.new_empty(t, width // 2, dtype=out_dtype)
    wrap_triton(_silu_mul_kernel)[(t, triton.cdiv(width // 2, block))](
        gate_up, out, scale, width // 2, gate_up.stride(0), out.stride(0), BLOCK=block, STATIC=scale > 0,
    )
    return out


@triton_op("slm::silu_mul", mutates_args={})  # exports into AOTInductor graphs
def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """As kernels.layer_ref.silu_mul_ref."""
    return _silu_mul_into(gate_up, gate_up.dtype, 0.0, block)


@triton_op("slm::silu_mul_static", mutates_args={})
def silu_mul_static(gate_up: torch.Tensor, scale: float, block: int = 1024) -> torch.Tensor:
    """As kernels.layer_ref.silu_mul_static_ref: E4M3 [T, I]. The scale is a number fixed at build,
    not a tensor: AOTInductor folds a 0-dim constant tensor into a value that a Triton kernel's
    signature cannot take (InductorError "'<=' not supported between 'Constant' and 'int'", the
    H200 build of 2026-12-01)."""
    return _silu_mul_into(gate_up, torch.float8_e4m3fn, scale, block)


@triton_op("slm::silu_mul_quant", mutates_args={})
def silu_mul_quant(gate_up: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """As kernels.layer_ref.silu_mul_quant_ref: E4M3 [T, I] and FP32 scales [T]."""
    t, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul_quant: needs [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
    q = gate_up.new_empty(t, width // 2, dtype=torch.float8_e4m3fn)
    scale = gate_up.new_empty(t, dtype=torch.float32)
    wrap_triton(_silu_mul_quant_kernel)[(t,)](gate_up, q, scale, width // 2, gate_up.stride(0), q.stride(0),
                                              BLOCK=block)
    return q, scale
