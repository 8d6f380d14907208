"""SiLU(gate) * up in one Triton kernel, and its wrapper. Reference: slm_kernels.layer_ref.silu_mul_ref.
For fp8-static (slm_core.compile.fp8), silu_mul_static also quantises it to E4M3 with one scale
fixed at build, so the [T, I] product is never written in the model dtype (reference:
kernels.layer_ref.silu_mul_static_ref).

The fused gate/up projection writes [T, 2I]; this reads each row's two halves once and writes
[T, I]. Inductor's own kernel for the same expression is autotuned at build time, so a build
beside other GPU work can pick a slow config; this one does not depend on that. The arithmetic
follows transformers' rounding
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
def _silu_mul_kernel(x_ptr, out_ptr, scale, inner, stride_x, stride_out, BLOCK: tl.constexpr, STATIC: tl.constexpr):
    """One block of a row; STATIC: divided by `scale`, saturated to E4M3's range."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inner
    y = _silu_mul(x_ptr, row, cols, ok, inner, stride_x, x_ptr.dtype.element_ty)
    if STATIC:
        y = tl.clamp((y / scale).to(tl.float32), -448.0, 448.0)  # AOTI may pass scale as fp64
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _silu_mul_into(gate_up: torch.Tensor, out_dtype: torch.dtype, scale: float, block: int):
    t, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: needs [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
    out = gate_up.new_empty(t, width // 2, dtype=out_dtype)
    wrap_triton(_silu_mul_kernel)[(t, triton.cdiv(width // 2, block))](
        gate_up,
        out,
        scale,
        width // 2,
        gate_up.stride(0),
        out.stride(0),
        BLOCK=block,
        STATIC=scale > 0,
    )
    return out


@triton_op("slm::silu_mul", mutates_args={})  # exports into AOTInductor graphs
def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """As slm_kernels.layer_ref.silu_mul_ref."""
    return _silu_mul_into(gate_up, gate_up.dtype, 0.0, block)


@triton_op("slm::silu_mul_static", mutates_args={})
def silu_mul_static(gate_up: torch.Tensor, scale: float, block: int = 1024) -> torch.Tensor:
    """As slm_kernels.layer_ref.silu_mul_static_ref: E4M3 [T, I]. The scale is a number fixed at build,
    not a tensor: AOTInductor folds a 0-dim constant tensor into a value that a Triton kernel's
    signature cannot take (InductorError "'<=' not supported between 'Constant' and 'int'")."""
    return _silu_mul_into(gate_up, torch.float8_e4m3fn, scale, block)
