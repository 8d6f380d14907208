"""The gate/up projection and SiLU(gate) * up in one Triton kernel, for the beam's decode steps.
Reference: kernels.layer_ref.gate_up_silu_ref (silu_mul_ref of the linear).

A decode step's MLP input is a few hundred rows (100 beams a prompt), so cuBLAS's gate/up GEMM
reads its 2I x K weights at a fraction of the H200's bandwidth and writes [T, 2I] for a second
kernel to read back (W2: 8.3 + 1.7 µs a layer and step, against 3.6 µs to read the 17 MB of
weights). Here each program holds BLOCK_M rows against BLOCK_N gate columns and the same up
columns, so SiLU·up is its epilogue and [T, 2I] is never written. The rounding points are those
of the two-kernel path: each projection rounded to the model dtype (after its bias), silu in FP32
rounded, then the product rounded.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels.online_softmax import launch_options


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, b_ptr, out_ptr, rows, inner, depth, stride_x, stride_w, stride_out,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BIAS: tl.constexpr):
    """out[m, n] = silu(x[m] . w[n] + b[n]) * (x[m] . w[inner + n] + b[inner + n]) for one tile."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok, n_ok = m < rows, n < inner
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_x
    gate_rows = w_ptr + n[None, :].to(tl.int64) * stride_w
    up_rows = gate_rows + inner * stride_w
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < depth
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[None, :] & k_ok[:, None]
        acc_gate = tl.dot(x, tl.load(gate_rows + k[:, None], mask=w_ok, other=0.0), acc_gate)
        acc_up = tl.dot(x, tl.load(up_rows + k[:, None], mask=w_ok, other=0.0), acc_up)
    if BIAS:
        acc_gate += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_ptr + inner + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_out + n[None, :], (act * up).to(dtype),
             mask=m_ok[:, None] & n_ok[None, :])


@triton_op("slm::gate_up_silu", mutates_args={})  # exports into AOTInductor graphs
def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, block_m: int = 64,
                 block_n: int = 32, block_k: int = 128, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """As kernels.layer_ref.gate_up_silu_ref: x [T, K], weight [2I, K] (gate rows, then up rows, as
    nn.Linear holds them), bias [2I] or None -> [T, I]. The block sizes are static for every T
    (the graphs' T is dynamic); the defaults are the kernel bench's best at W2's 100-800 rows."""
    t, depth = x.shape
    width = weight.shape[0]
    if width % 2 or weight.shape[1] != depth or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gate_up_silu: needs x [T, K] and weight [2I, K] with contiguous rows, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    inner = width // 2
    out = x.new_empty(t, inner)
    wrap_triton(_gate_up_silu_kernel)[(triton.cdiv(inner, block_n), triton.cdiv(t, block_m))](
        x, weight, weight if bias is None else bias, out, t, inner, depth, x.stride(0), weight.stride(0),
        out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BIAS=bias is not None,
        **launch_options(num_warps, num_stages),
    )
    return out
