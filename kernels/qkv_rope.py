"""QK-norm + RoPE in one Triton kernel, and its wrappers. References: kernels.layer_ref.qkv_rope_ref
and qkv_rope_step_ref.

One program per token: it reads the token's fused QKV row once, RMS-normalises each q and k head
(when the model has QK-norm), rotates them and writes q, k and a contiguous v. In a decode step
(qkv_rope_step) k and v go into the beams' suffix cache at the step's slot, and the program also
carries its beam's earlier slots into the new cache: the cache grows inside a kernel the step
runs anyway, where a concatenation per layer and step cost two kernels more. What it replaces in
the compiled graphs was two Inductor kernels per layer at under 1 TB/s (18 + 10 µs per W1 layer
on the H200). The arithmetic is FP32 with transformers' rounding points of the QK-norm
(normalised value and weighted value in the model dtype); RoPE is rounded once, at the store.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def _norm_rotate(src, dst, w_ptr, cos, sin, eps, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                 HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
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
def _rotate_token(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_dst, k_dst, v_dst, eps, t, stride_qkv, stride_cos,
                  HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, V_PAD: tl.constexpr, NORM: tl.constexpr):
    """Token t's q, k (normalised, rotated) and v to q_dst, k_dst and v_dst."""
    d = tl.arange(0, HEAD_DIM // 2)[None, :]
    cos = tl.load(cos_ptr + t * stride_cos + d).to(tl.float32)  # the first half; the second is equal
    sin = tl.load(sin_ptr + t * stride_cos + d).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    _norm_rotate(row, q_dst, qw_ptr, cos, sin, eps, HEADS, HEADS_PAD, HEAD_DIM, NORM)
    _norm_rotate(row + HEADS * HEAD_DIM, k_dst, kw_ptr, cos, sin, eps, KV_HEADS, KV_PAD, HEAD_DIM, NORM)
    cols = tl.arange(0, V_PAD)
    v_ok = cols < KV_HEADS * HEAD_DIM
    v = tl.load(row + (HEADS + KV_HEADS) * HEAD_DIM + cols, mask=v_ok)
    tl.store(v_dst + cols, v, mask=v_ok)


@triton.jit
def _qkv_rope_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr, eps, stride_qkv, stride_cos,
    HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_PAD: tl.constexpr, NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    kv = KV_HEADS * HEAD_DIM
    _rotate_token(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr + t * (HEADS * HEAD_DIM), k_ptr + t * kv,
                  v_ptr + t * kv, eps, t, stride_qkv, stride_cos, HEADS, HEADS_PAD, KV_HEADS, KV_PAD, HEAD_DIM,
                  V_PAD, NORM)


@triton.jit
def _qkv_rope_step_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, old_ptr, new_ptr, eps, slot, stride_qkv, stride_cos,
    stride_row, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_PAD: tl.constexpr, NORM: tl.constexpr, COPY_BLOCK: tl.constexpr,
):
    """Beam t: q, then K and V at the slot of its row of the new cache (a slot is K then V,
    2 * KV_HEADS * HEAD_DIM values), then its earlier slots copied from the old cache."""
    t = tl.program_id(0).to(tl.int64)
    kv = KV_HEADS * HEAD_DIM
    dst = new_ptr + t * stride_row + slot * (2 * kv)
    _rotate_token(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr + t * (HEADS * HEAD_DIM), dst, dst + kv, eps, t,
                  stride_qkv, stride_cos, HEADS, HEADS_PAD, KV_HEADS, KV_PAD, HEAD_DIM, V_PAD, NORM)
    earlier = slot * (2 * kv)  # a row's slots are contiguous
    for c0 in range(0, earlier, COPY_BLOCK):
        cols = c0 + tl.arange(0, COPY_BLOCK)
        ok = cols < earlier
        tl.store(new_ptr + t * stride_row + cols, tl.load(old_ptr + t * stride_row + cols, mask=ok), mask=ok)


@triton_op("slm::qkv_rope", mutates_args={})  # exports into AOTInductor graphs
def qkv_rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
    q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As kernels.layer_ref.qkv_rope_ref; q, k, v come back contiguous."""
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
        qkv, cos, sin, q_weight if norm else qkv, k_weight if norm else qkv, q, k, v, eps,
        qkv.stride(0), cos.stride(0),
        HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), KV_HEADS=kv_heads,
        KV_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=d, V_PAD=triton.next_power_of_2(kv_heads * d), NORM=norm,
    )
    return q, k, v


@triton_op("slm::qkv_rope_step", mutates_args={})  # exports into AOTInductor graphs
def qkv_rope_step(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
    q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor], eps: float, cache: torch.Tensor, slot: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As kernels.layer_ref.qkv_rope_step_ref: q (contiguous) and the new cache (contiguous)."""
    t, d = qkv.shape[0], cos.shape[-1]
    if (qkv.shape[1] != (heads + 2 * kv_heads) * d or d % 2 or d & (d - 1) or cos.shape != sin.shape
            or cache.dim() != 5 or cache.shape[0] != t or tuple(cache.shape[2:]) != (2, kv_heads, d)
            or not 0 <= slot < cache.shape[1]):
        raise ValueError(f"qkv_rope_step: unsupported shapes qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, "
                         f"cache {tuple(cache.shape)} at slot {slot}")
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride() or not cache.is_contiguous():
        raise ValueError("qkv_rope_step: rows of qkv, cos and sin, and the cache, must be contiguous")
    q = qkv.new_empty(t, heads, d)
    new = torch.empty_like(cache)
    norm = q_weight is not None
    wrap_triton(_qkv_rope_step_kernel)[(t,)](
        qkv, cos, sin, q_weight if norm else qkv, k_weight if norm else qkv, q, cache, new, eps, slot,
        qkv.stride(0), cos.stride(0), cache.stride(0),
        HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), KV_HEADS=kv_heads,
        KV_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=d, V_PAD=triton.next_power_of_2(kv_heads * d), NORM=norm,
        COPY_BLOCK=1024,
    )
    return q, new
