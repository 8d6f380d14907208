"""SiLU(gate) * up in one Triton kernel, and its wrapper. Reference: kernels.layer_ref.silu_mul_ref.

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
def _silu_mul_kernel(x_ptr, out_ptr, inner, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=ok)


@triton_op("slm::silu_mul", mutates_args={})  # exports into AOTInductor graphs
def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """As kernels.layer_ref.silu_mul_ref."""
    t, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: needs [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
    out = gate_up.new_empty(t, width // 2)
    wrap_triton(_silu_mul_kernel)[(t, triton.cdiv(width // 2, block))](
        gate_up, out, width // 2, gate_up.stride(0), out.stride(0), BLOCK=block,
    )
    return out
