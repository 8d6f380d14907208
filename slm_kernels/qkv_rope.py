"""QK-norm + RoPE in one Triton kernel, and its wrapper. Reference: slm_kernels.layer_ref.qkv_rope_ref.

One program per token: it reads the token's fused QKV row once, RMS-normalises each q and k head
(when the model has QK-norm), rotates them and writes q, k and a contiguous v: one pass where
Inductor generates two kernels that read the row at a fraction of the memory's rate. The
arithmetic is FP32 with transformers' rounding points of the QK-norm
(normalised value and weighted value in the model dtype); RoPE is rounded once, at the store.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def _norm_rotate(
    src,
    dst,
    w_ptr,
    cos,
    sin,
    eps,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NORM: tl.constexpr,
):
    """Heads [HEADS, HEAD_DIM] at src -> normalised (NORM) and rotated at dst (contiguous)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF)[None, :]
    ok = h < HEADS
    x1 = tl.load(src + h * HEAD_DIM + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * HEAD_DIM + HALF + d, mask=ok, other=0.0).to(tl.float32)
    dtype = dst.dtype.element_ty
    if NORM:
        r = tl.rsqrt(((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps).to(tl.float32))[:, None]
        w1 = tl.load(w_ptr + d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
        x1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    tl.store(dst + h * HEAD_DIM + d, (x1 * cos - x2 * sin).to(dtype), mask=ok)
    tl.store(dst + h * HEAD_DIM + HALF + d, (x2 * cos + x1 * sin).to(dtype), mask=ok)


@triton.jit
def _qkv_rope_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    eps,
    stride_qkv,
    stride_cos,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr,
    KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_PAD: tl.constexpr,
    NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM // 2)[None, :]
    cos = tl.load(cos_ptr + t * stride_cos + d).to(tl.float32)  # the first half; the second is equal
    sin = tl.load(sin_ptr + t * stride_cos + d).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    _norm_rotate(row, q_ptr + t * (HEADS * HEAD_DIM), qw_ptr, cos, sin, eps, HEADS, HEADS_PAD, HEAD_DIM, NORM)
    _norm_rotate(
        row + HEADS * HEAD_DIM,
        k_ptr + t * (KV_HEADS * HEAD_DIM),
        kw_ptr,
        cos,
        sin,
        eps,
        KV_HEADS,
        KV_PAD,
        HEAD_DIM,
        NORM,
    )
    cols = tl.arange(0, V_PAD)
    v_ok = cols < KV_HEADS * HEAD_DIM
    v = tl.load(row + (HEADS + KV_HEADS) * HEAD_DIM + cols, mask=v_ok)
    tl.store(v_ptr + t * (KV_HEADS * HEAD_DIM) + cols, v, mask=v_ok)


@triton_op("slm::qkv_rope", mutates_args={})  # exports into AOTInductor graphs
def qkv_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As slm_kernels.layer_ref.qkv_rope_ref; q, k, v come back contiguous."""
    t, d = qkv.shape[0], cos.shape[-1]
    if qkv.shape[1] != (heads + 2 * kv_heads) * d or d % 2 or d & (d - 1) or cos.shape != sin.shape:
        raise ValueError(f"qkv_rope: unsupported shapes qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}")
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("qkv_rope: rows of qkv, cos and sin must be contiguous")
    q = qkv.new_empty(t, heads, d)
    k = qkv.new_empty(t, kv_heads, d)
    v = qkv.new_empty(t, kv_heads, d)
    norm = q_weight is not None
    wrap_triton(_qkv_rope_kernel)[(t,)](
        qkv,
        cos,
        sin,
        q_weight if norm else qkv,
        k_weight if norm else qkv,
        q,
        k,
        v,
        eps,
        qkv.stride(0),
        cos.stride(0),
        HEADS=heads,
        HEADS_PAD=triton.next_power_of_2(heads),
        KV_HEADS=kv_heads,
        KV_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM=d,
        V_PAD=triton.next_power_of_2(kv_heads * d),
        NORM=norm,
    )
    return q, k, v
